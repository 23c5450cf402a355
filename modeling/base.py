"""What every family shares: the pre-norm block, the base model and the causal-LM head (the architecture; saving and
uploading are in :mod:`.hub`).

A family provides its config class and its mixer (``mixer_class``, see :class:`~.mixer.Mixer`); the mixer maps
right-padded rows ``(N, L, D)`` (see :mod:`.layout`) to ``(N, L, D)`` and keeps its decoding state in a
:class:`~.mixer.LayerState`. Where the kernels take packed sequences (``dispatch.keeps_packed``) they stay packed: the
mixer then gets ``(1, total, D)`` and ``cu_seqlens`` instead of rows, and still leaves one state row per sequence.
"""

from __future__ import annotations

import os
import re

import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.utils import logging
from transformers.utils.generic import can_return_tuple

from ..kernels.dispatch import keeps_packed, resolve_backend
from .cache import SelectiveRopeCache
from .hub import HubMixin, unsharded_class
from .inputs import (
    CACHE_FIELD,
    check_cache,
    check_kwargs,
    check_labels,
    check_tokens,
    one_cache,
    packed_offsets,
    padding_mask,
    returned_cache,
)
from .layers import GatedMLP, RMSNorm
from .layout import SequenceLayout
from .mixer import LayerState, Mixer
from .rotary import SelectiveRotaryEmbedding

logger = logging.get_logger(__name__)


class SelectiveRopeDecoderBlock(GradientCheckpointingLayer):
    """``x + mixer(norm(x))`` then ``x + mlp(norm(x))``."""

    def __init__(self, config, layer_idx: int, mixer_class: type[Mixer]):
        super().__init__()
        self.layer_idx = layer_idx
        self.attn_norm = RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.attn = mixer_class(config, layer_idx)
        self.mlp_norm = RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.mlp_width, bias=config.mlp_has_bias,
                            activation=config.hidden_act)

    def forward(self, hidden_states: torch.Tensor, state: LayerState, lengths: torch.Tensor | None = None,
                cu_seqlens: torch.Tensor | None = None, backend: str = "torch") -> torch.Tensor:
        hidden_states = hidden_states + self.attn(self.attn_norm(hidden_states), state, lengths=lengths,
                                                  cu_seqlens=cu_seqlens, backend=backend)
        return hidden_states + self.mlp(self.mlp_norm(hidden_states))


class SelectiveRopePreTrainedModel(HubMixin, PreTrainedModel):
    """Weight initialisation and the transformers flags shared by every family (Hub methods: :class:`.hub.HubMixin`)."""

    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["SelectiveRopeDecoderBlock"]
    # The Selective RoPE module (temperature, phase projection, convolution, bias, gate: a few thousand
    # parameters per layer) stays float32 when the model loads in bf16/fp16, so the whole phase path is float32.
    _keep_in_fp32_modules_strict = ["rotary"]
    _is_stateful = True  # states that cannot be rolled back (recurrences, phases): no assisted generation
    _supports_attention_backend = False  # our mixers do not go through transformers' attention interface
    # Context parallelism shards the sequence across ranks; our recurrent states, forget-gate sums and Selective RoPE
    # phases run along the whole sequence and are never exchanged between ranks.
    _supports_context_parallel = False

    def post_init(self) -> None:
        self._upcast_strict_float32_parameters()
        super().post_init()  # initialises the weights: those kept float32 are drawn in float32

    @torch.no_grad()
    def _upcast_strict_float32_parameters(self) -> None:
        """Make the tensors ``_keep_in_fp32_modules_strict`` names float32 where the model was built in fp16/bf16.

        ``from_pretrained(..., dtype=torch.bfloat16)`` keeps them float32 by its dtype plan, but
        ``from_config(config, dtype=torch.bfloat16)`` (how a bf16 model is built to train from scratch) only sets the
        default dtype while the model is built, so the phase weights (and Gated DeltaNet's ``A_log``, ``dt_bias``)
        would be created, trained and saved in bf16. Matched as transformers matches the names: whole dotted parts.
        DeepSpeed ZeRO-3 partitions parameters as they are built and manages their dtype itself: left alone."""
        keys = self._keep_in_fp32_modules_strict
        if not keys or is_deepspeed_zero3_enabled():
            return
        kept = re.compile("|".join(rf"(^|\.){re.escape(key)}($|\.)" for key in keys))
        for name, tensor in (*self.named_parameters(), *self.named_buffers()):  # (a fixed temperature is a buffer)
            if tensor.dtype in (torch.float16, torch.bfloat16) and kept.search(name):
                tensor.data = tensor.data.float()

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)  # Linear / Conv1d: N(0, initializer_range); Embedding; RMSNorm ones
        if isinstance(module, SelectiveRotaryEmbedding) and module.position_embedding != "nope":
            init.copy_(module.temperature, module.initial_temperature())
            if getattr(module, "phase_bias", None) is not None:
                init.zeros_(module.phase_bias)
        elif hasattr(module, "init_custom_parameters"):  # our modules with non-standard parameters
            module.init_custom_parameters()

    def shard_rotary_in_float32(self, mesh=None) -> None:
        """Make every Selective RoPE module its own FSDP2 unit whose parameters and computation stay float32.

        FSDP2's mixed precision casts all parameters of a ``fully_shard`` unit to its ``param_dtype`` for the forward,
        and accelerate (``Trainer(fsdp=...)``) applies one policy to every unit: without this call the phase path
        inside each decoder block would run on bf16 copies of the temperature and phase weights (a bf16 temperature
        is off by up to 0.4 %, which turns into radians of rotation error after a few hundred tokens). Call it after
        torch.distributed is initialised (``TrainingArguments(fsdp=True, ...)`` does that) and before the model is
        sharded (``Trainer(model, ...)``): accelerate then shards the rest and leaves these units alone. Call it in
        every run of a training, resumed ones too: the Trainer gives these parameters optimizer groups of their own,
        which a checkpoint must match. ``mesh``: the device mesh to shard over (default: all ranks, as accelerate).

        Not with ``fsdp_config["cpu_ram_efficient_loading"]``, which re-loads rank 0's full weights into the model
        after this and cannot handle units that are already sharded.
        """
        from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

        if os.environ.get("FSDP_CPU_RAM_EFFICIENT_LOADING", "false").lower() in ("1", "true"):
            raise ValueError("shard_rotary_in_float32() cannot be combined with "
                             "fsdp_config['cpu_ram_efficient_loading']=True (FSDP_CPU_RAM_EFFICIENT_LOADING)")
        if not torch.distributed.is_initialized():
            raise RuntimeError("shard_rotary_in_float32() needs an initialised torch.distributed process group: "
                               "launch several processes (torchrun) and call it after TrainingArguments(fsdp=True, "
                               "...) or init_process_group()")
        # Inputs (bf16 activations) are not cast: the module casts what it needs and returns q, k in their dtype.
        policy = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32, cast_forward_inputs=False)
        for module in self.modules():
            is_new = isinstance(module, SelectiveRotaryEmbedding) and not isinstance(module, FSDPModule)
            if is_new and module.position_embedding != "nope":  # NoPE has no parameters
                fully_shard(module.float(), mesh=mesh, mp_policy=policy)

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        # generate() must not build a DynamicCache for us: our forward creates a SelectiveRopeCache.
        return False

class SelectiveRopeModelBase(SelectiveRopePreTrainedModel):
    """Embeddings -> blocks -> final norm. Subclasses set ``config_class`` and ``mixer_class``; ``lm_class`` is set by
    the family's causal-LM class, which names this one as its ``model_class``."""

    mixer_class: type[Mixer]
    lm_class: type[PreTrainedModel]  # the family's SelectiveRopeForCausalLMBase subclass

    def __init__(self, config):
        super().__init__(config)
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList(self.decoder_block(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.gradient_checkpointing = False
        self.post_init()

    def decoder_block(self, config, layer_idx: int) -> nn.Module:
        """The block of layer ``layer_idx``: the family's mixer in every layer (the hybrid's differ by layer)."""
        return SelectiveRopeDecoderBlock(config, layer_idx, self.mixer_class)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embeddings

    def _auto_classes(self) -> tuple[type, type]:
        cls = unsharded_class(type(self))
        return cls, cls.lm_class

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embeddings = value

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: SelectiveRopeCache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        cu_seqlens: torch.LongTensor | None = None,
        cache: SelectiveRopeCache | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        """
        Args:
            input_ids: ``(B, T)`` token ids; or ``inputs_embeds``: ``(B, T, hidden_size)``, floating point, cast to
                the dtype of the input embeddings' weight (the dtype ``input_ids`` would give).
            attention_mask: padding mask (1 or True = real token, 0 = padding, anywhere in a row) of shape ``(B, T)``
                or ``(B, T_past + T)`` (``T_past``: the tokens already in the cache, as ``generate`` passes
                it). Only its last ``T`` columns mark this call's tokens. Values other than 0 and 1 are refused (an
                additive 0 / -inf mask would read inverted).
            position_ids: positions are implicit (the phase counts real tokens); ``position_ids`` are read only as
                transformers' packing convention (batch 1, restarting at 0 at each sequence, as
                ``DataCollatorWithFlattening`` gives), otherwise they must equal the implicit positions.
            past_key_values: a :class:`SelectiveRopeCache` to continue from (created when ``use_cache`` and None),
                returned as ``outputs.cache`` (transformers >= 5.24) or ``outputs.past_key_values`` (before).
            cu_seqlens: packed sequences: ``input_ids`` of shape ``(1, total)`` and offsets ``[0, ..., total]``; each
                sequence gets exactly the outputs it has alone (the cache then holds one row per sequence).
            cache: the same as ``past_key_values``, under the name transformers uses from 5.24 on (give one of the
                two).
            kwargs: transformers' packing keywords ``cu_seq_lens_q`` / ``cu_seq_lens_k`` / ``max_length_q`` /
                ``max_length_k`` and ``seq_idx`` (the same packed path as ``cu_seqlens``), ``num_items_in_batch``
                and ``cache_position`` (not needed here), ``output_attentions`` / ``output_router_logits`` (False)
                and ``is_causal`` (True). Any other name raises a ``TypeError``; see :mod:`.inputs`.
        """
        markers = check_kwargs(kwargs, type(self).__name__)
        batch, seq_len = check_tokens(input_ids, inputs_embeds, self.config.vocab_size, self.config.hidden_size)
        if use_cache is None:  # in training the final states would only be thrown away
            use_cache = self.config.use_cache and not self.training
        if self.gradient_checkpointing and self.training and use_cache:
            logger.warning_once("use_cache=True is incompatible with gradient checkpointing; setting use_cache=False")
            use_cache = False
        cache = one_cache(past_key_values, cache)
        check_cache(cache, len(self.layers), self.config.model_type)
        past_len = cache.get_seq_length() if cache is not None else 0
        mask = padding_mask(attention_mask, batch, seq_len, past_len)
        cu_seqlens = packed_offsets(cu_seqlens, position_ids, markers, batch, seq_len, mask, past_len)
        if use_cache and cache is None:
            cache = SelectiveRopeCache(self.config)

        hidden_states = self.embeddings(input_ids) if inputs_embeds is None else self._embedded(inputs_embeds)
        # Which kernels run, decided once for the whole call (SELECTIVE_ROPE_BACKEND may override the config).
        backend = resolve_backend(self.config.backend, hidden_states.device)
        packed = None  # offsets of the sequences packed in `rows` when the mixers take them as they are
        if cu_seqlens is not None and keeps_packed(backend, hidden_states.device):
            # fla's kernels and our Triton rotary kernel take packed sequences natively: no padding to pay for.
            packed = cu_seqlens.to(device=hidden_states.device, dtype=torch.int32)
        layout = None if packed is not None else self._layout(hidden_states.shape[:2], mask, cu_seqlens)
        rows = hidden_states if layout is None else layout.to_rows(hidden_states)  # (N, L, D), or (1, total, D)
        lengths = None if layout is None else layout.lengths
        restore = (lambda x: x) if layout is None else layout.from_rows
        self._check_cache_batch(cache, rows.shape[0] if packed is None else packed.numel() - 1)

        all_hidden_states = [] if output_hidden_states else None
        for layer_idx, block in enumerate(self.layers):
            if all_hidden_states is not None:
                all_hidden_states.append(restore(rows))
            cached = cache.layers[layer_idx] if cache is not None else None
            state = LayerState(cached.states if cached is not None else None, keep=use_cache)
            rows = block(rows, state, lengths=lengths, cu_seqlens=packed, backend=backend)
            if use_cache:
                cached.commit(state.new, num_new_tokens=hidden_states.shape[1], token_states=state.token_histories)
        hidden_states = restore(self.norm(rows))
        if all_hidden_states is not None:
            all_hidden_states.append(hidden_states)

        return BaseModelOutputWithPast(
            last_hidden_state=hidden_states,
            hidden_states=tuple(all_hidden_states) if all_hidden_states is not None else None,
            **{CACHE_FIELD: cache if use_cache else None},
        )

    def _embedded(self, inputs_embeds: torch.Tensor) -> torch.Tensor:
        # In the dtype input_ids would give (the embedding weight's): the first Linear would refuse float32 embeddings
        # in a bf16 model, or float64 ones in a float32 model, deep in a layer.
        return inputs_embeds.to(self.embeddings.weight.dtype)

    @staticmethod
    def _check_cache_batch(cache: SelectiveRopeCache | None, rows: int) -> None:
        states = cache.layers[0].states if cache is not None and len(cache.layers) else {}
        cached_rows = next(iter(states.values())).shape[0] if states else rows
        if cached_rows != rows:
            raise ValueError(f"the cache (cache / past_key_values) holds {cached_rows} sequences but the input has "
                             f"{rows} (with cu_seqlens, one per packed sequence)")

    @staticmethod
    def _layout(grid, mask, cu_seqlens) -> SequenceLayout | None:
        """Rows for the mixers from the inputs ``forward`` checked: the bool padding ``mask`` ``(B, T_past + T)``
        or ``(B, T)``, or the packed sequences' ``cu_seqlens``."""
        seq_len = grid[1]
        if cu_seqlens is not None:
            return SequenceLayout.from_cu_seqlens(cu_seqlens, total=seq_len)
        if mask is None:
            return None
        return SequenceLayout.from_attention_mask(mask[:, -seq_len:])


class SelectiveRopeForCausalLMBase(SelectiveRopePreTrainedModel, GenerationMixin):
    """Language-model head over a family's base model. Subclasses set ``config_class`` and ``model_class``."""

    model_class: type[SelectiveRopeModelBase]
    _tied_weights_keys = {"lm_head.weight": "model.embeddings.weight"}

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "model_class" in cls.__dict__:  # a family's LM class (not a class FSDP derives from it)
            cls.model_class.lm_class = cls

    def __init__(self, config):
        super().__init__(config)
        self.model = self.model_class(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def _auto_classes(self) -> tuple[type, type]:
        return self.model_class, unsharded_class(type(self))

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: SelectiveRopeCache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        cu_seqlens: torch.LongTensor | None = None,
        cache: SelectiveRopeCache | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """``labels`` ``(B, T)`` (int64 or int32; -100 = ignored, else a token id) gives the shifted next-token loss
        through ``self.loss_function``, which honours Trainer's ``num_items_in_batch``; they are checked before the
        forward runs. ``logits_to_keep`` keeps only the last N positions. The other arguments are the base model's
        (see ``SelectiveRopeModelBase.forward``)."""
        num_items_in_batch = kwargs.pop("num_items_in_batch", None)  # the loss's; every other keyword is the model's
        labels = check_labels(labels, input_ids, inputs_embeds, self.config.vocab_size)
        if labels is not None and not (isinstance(logits_to_keep, int) and logits_to_keep in (0, labels.shape[1])):
            raise ValueError(f"labels need the logits of every position, but logits_to_keep={logits_to_keep!r} keeps "
                             "fewer: pass logits_to_keep=0 (the default) with labels")
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            output_hidden_states=output_hidden_states,
            cu_seqlens=cu_seqlens,
            cache=cache,
            **kwargs,
        )
        hidden_states = outputs.last_hidden_state
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden_states[:, keep, :])
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size,
                                      num_items_in_batch=num_items_in_batch)
        return CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            hidden_states=outputs.hidden_states,
            **{CACHE_FIELD: returned_cache(outputs)},
        )

    def _prepare_position_ids_for_generation(self, inputs_tensor, model_kwargs):
        # generate() (transformers >= 5.10) builds position_ids from the mask when the caller passes none, then
        # extends them by one per step from the last column: after right padding or a row of padding only, that is
        # not the positions these models count, and forward refuses them. Our forward counts positions itself, so
        # generate builds none; position_ids the caller passes to generate still go through forward's checks.
        return None
