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
from .cache import SelectiveRopeCache, SelectiveRopeStaticCache
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
from .layout import AttentionLayout, SequenceLayout
from .mixer import LayerState, Mixer
from .rotary import SelectiveRotaryEmbedding
from .tensor_parallel import check_tensor_parallel

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
        x = self.attn_norm(hidden_states)  # (B, T, D)
        hidden_states = hidden_states + self.attn(x, state, lengths=lengths, cu_seqlens=cu_seqlens, backend=backend,
                                                  phase_input=self._phase_input(hidden_states, x))
        return hidden_states + self.feed_forward(self.mlp_norm(hidden_states), lengths)

    def feed_forward(self, x: torch.Tensor, lengths: torch.Tensor | None) -> torch.Tensor:
        """``(B, T, D)`` -> ``(B, T, D)``. ``lengths``: real tokens per row (None: all), for blocks that route
        tokens."""
        return self.mlp(x)

    def _phase_input(self, hidden_states: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """What the Selective RoPE phase path reads: the attention norm's output ``x``, or for a bf16/fp16 model the
        same norm in float32, unrounded. Rounded to bf16, it moved each token's phase increment by an error fixed per
        token, which adds up over the long spans a slowly decaying state reads across (docs/precision.md). RoPE and
        NoPE read no input."""
        if hidden_states.dtype in (torch.bfloat16, torch.float16) and \
                self.attn.rotary.position_embedding == "selective_rope":
            return self.attn_norm(hidden_states.float())  # (B, T, D) float32
        return x


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
    def maybe_distribute_model(cls, model, distributed_config, mesh_manager):
        """transformers' sharding (``from_pretrained(..., tp_plan="auto")`` or ``distributed_config=``), after a
        one-line error where the config cannot be split by heads across the tensor-parallel ranks."""
        if distributed_config is not None and model.config.base_model_tp_plan:  # (transformers refuses a model without)
            check_tensor_parallel(model.config, distributed_config.tp_size)
        return super().maybe_distribute_model(model, distributed_config, mesh_manager)

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
        output_attentions: bool | None = None,
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
            output_hidden_states: return every block's input and the final output (``config.output_hidden_states``
                when None).
            output_attentions: return the attention weights of the softmax-attention layers (FoX), one
                ``(B, H, T, T_past + T)`` tensor per such layer: this call's queries against the key timeline, the
                ``T_past`` cached keys (in token order; a row's padding from earlier calls sits after that call's
                real tokens) then this call's ``T`` tokens, zero at padding. Computed by an eager path (the whole
                weight matrix). ``config.output_attentions`` when None; True is refused for a model without such
                layers and for packed sequences.
            cu_seqlens: packed sequences: ``input_ids`` of shape ``(1, total)`` and offsets ``[0, ..., total]``; each
                sequence gets exactly the outputs it has alone (the cache then holds one row per sequence).
            cache: the same as ``past_key_values``, under the name transformers uses from 5.24 on (give one of the
                two).
            kwargs: transformers' packing keywords ``cu_seq_lens_q`` / ``cu_seq_lens_k`` / ``max_length_q`` /
                ``max_length_k`` and ``seq_idx`` (the same packed path as ``cu_seqlens``), ``num_items_in_batch``
                and ``cache_position`` (not needed here), ``output_router_logits`` (False)
                and ``is_causal`` (True). Any other name raises a ``TypeError``; see :mod:`.inputs`.
        """
        markers = check_kwargs(kwargs, type(self).__name__)
        if output_hidden_states is None:
            output_hidden_states = self.config.output_hidden_states
        output_attentions = self._wants_attentions(output_attentions)
        batch, seq_len = check_tokens(input_ids, inputs_embeds, self.config.vocab_size, self.config.hidden_size)
        if use_cache is None:  # in training the final states would only be thrown away
            use_cache = self.config.use_cache and not self.training
        if self.gradient_checkpointing and self.training and use_cache:
            logger.warning_once("use_cache=True is incompatible with gradient checkpointing; setting use_cache=False")
            use_cache = False
        cache = one_cache(past_key_values, cache)
        check_cache(cache, len(self.layers), self.config.model_type)
        static = cache is not None and cache.is_compileable  # a static cache (compiled decoding)
        # A compiled step does not read the static cache's length: it is a device counter (a host read would sync).
        if static and torch.compiler.is_compiling():
            past_len = None
        else:
            past_len = cache.get_seq_length() if cache is not None else 0
        mask = padding_mask(attention_mask, batch, seq_len, past_len)
        cu_seqlens = packed_offsets(cu_seqlens, position_ids, markers, batch, seq_len, mask, past_len)
        if output_attentions and cu_seqlens is not None:
            raise ValueError("output_attentions=True is not supported with packed sequences (cu_seqlens, "
                             "cu_seq_lens_q/k, seq_idx or restarting position_ids): pass them as a padded batch")
        if use_cache and cache is None:
            cache = SelectiveRopeCache(self.config)

        hidden_states = self.embeddings(input_ids) if inputs_embeds is None else self._embedded(inputs_embeds)
        # Which kernels run, decided once for the whole call (SELECTIVE_ROPE_BACKEND may override the config).
        backend = resolve_backend(self.config.backend, hidden_states.device)
        packed = None  # offsets of the sequences packed in `rows` when the mixers take them as they are
        if cu_seqlens is not None and keeps_packed(backend, hidden_states.device):
            # fla's kernels and our Triton rotary kernel take packed sequences natively: no padding to pay for.
            packed = cu_seqlens.to(device=hidden_states.device, dtype=torch.int32)
        step_valid = None  # a static cache's one-token step: whether each row's token is real (B,), not read here
        if static and seq_len == 1 and mask is not None and cu_seqlens is None:
            step_valid, mask = mask[:, -1], None  # (a layout would branch on its values and reorder nothing)
        layout = None if packed is not None else self._layout(hidden_states.shape[:2], mask, cu_seqlens)
        rows = hidden_states if layout is None else layout.to_rows(hidden_states)  # (N, L, D), or (1, total, D)
        lengths = None if layout is None else layout.lengths
        restore = (lambda x: x) if layout is None else layout.from_rows
        if step_valid is not None:  # pads output zeros, as a layout gives them
            lengths = step_valid.long()
            restore = lambda x: x.masked_fill(~step_valid[:, None, None], 0)  # noqa: E731
        self._check_cache_batch(cache, rows.shape[0] if packed is None else packed.numel() - 1)

        all_hidden_states = [] if output_hidden_states else None
        all_attentions = [] if output_attentions else None
        # (packed sequences with output_attentions are refused above: a layout here is a padding one)
        attention_layout = AttentionLayout(layout, past_len) if output_attentions and layout is not None else None
        for layer_idx, block in enumerate(self.layers):
            if all_hidden_states is not None:
                all_hidden_states.append(restore(rows))
                if layout is not None:  # continue from the returned states, so that gradients reach them
                    rows = layout.to_rows(all_hidden_states[-1])
            cached = cache.layers[layer_idx] if cache is not None else None
            state = LayerState(cached.states if cached is not None else None, keep=use_cache, layer=cached,
                               output_attentions=output_attentions, attention_layout=attention_layout)
            rows = block(rows, state, lengths=lengths, cu_seqlens=packed, backend=backend)
            if state.attentions is not None:
                all_attentions.append(state.attentions)  # (B, H, T, T_past + T)
            if use_cache:
                cached.commit(state.new, num_new_tokens=hidden_states.shape[1], token_states=state.token_histories)
        hidden_states = restore(self.norm(rows))
        if all_hidden_states is not None:
            all_hidden_states.append(hidden_states)

        return BaseModelOutputWithPast(
            last_hidden_state=hidden_states,
            hidden_states=tuple(all_hidden_states) if all_hidden_states is not None else None,
            attentions=tuple(all_attentions) if all_attentions is not None else None,
            **{CACHE_FIELD: cache if use_cache else None},
        )

    def _wants_attentions(self, requested: bool | None) -> bool:
        """Whether to return attention weights: ``requested``, or the config's ``output_attentions`` when None (which
        then applies only where there are weights: a linear-attention model returns none)."""
        has_weights = any(getattr(block.attn, "has_attention_weights", False) for block in self.layers)
        if requested is None:
            return bool(self.config.output_attentions) and has_weights
        if requested and not has_weights:
            raise ValueError(f"output_attentions=True: this {self.config.model_type} model has no attention weights "
                             "to return (its layers are linear attention, not softmax attention)")
        return bool(requested)

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
    _tp_plan = {"lm_head": "colwise_gather_output"}  # as Llama's: each rank its vocabulary rows, logits gathered

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
        output_attentions: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        cu_seqlens: torch.LongTensor | None = None,
        cache: SelectiveRopeCache | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """``labels`` ``(B, T)`` (int64 or int32; -100 = ignored, else a token id) gives the shifted next-token loss
        through ``self.loss_function``, which honours Trainer's ``num_items_in_batch`` and ``shift_labels`` (labels
        already shifted, ``(B, T)``, as Trainer passes them under context / sequence parallelism; they need
        ``labels`` too, as in transformers' causal LMs); both are checked before the forward runs.
        ``logits_to_keep`` keeps only the last N positions. The other arguments are the base model's (see
        ``SelectiveRopeModelBase.forward``)."""
        # The loss's keywords; every other one is the base model's, checked here so that errors name this class.
        num_items_in_batch = kwargs.pop("num_items_in_batch", None)
        shift_labels = kwargs.pop("shift_labels", None)
        check_kwargs(kwargs, type(self).__name__)
        labels = check_labels(labels, input_ids, inputs_embeds, self.config.vocab_size)
        if shift_labels is not None:
            if labels is None:
                raise ValueError("shift_labels are given without labels: the loss is computed when labels are given "
                                 "(pass both, as Trainer does)")
            shift_labels = check_labels(shift_labels, input_ids, inputs_embeds, self.config.vocab_size,
                                        name="shift_labels")
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
            output_attentions=output_attentions,
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
                                      num_items_in_batch=num_items_in_batch, shift_labels=shift_labels)
        return CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            **{CACHE_FIELD: returned_cache(outputs)},
        )

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, generation_mode, batch_size: int,
                                      max_cache_length: int):
        """``generate(..., cache_implementation="static")`` builds a :class:`SelectiveRopeStaticCache` here, sized for
        the whole generation (transformers would skip ``cache_implementation`` for a model that does not take its
        ``DynamicCache``); anything else goes to transformers (our forward then creates the dynamic cache)."""
        user_cache = model_kwargs.get(CACHE_FIELD) is not None
        if generation_config.cache_implementation != "static" or user_cache or generation_config.use_cache is False:
            return super()._prepare_cache_for_generation(generation_config, model_kwargs, generation_mode, batch_size,
                                                         max_cache_length)
        if generation_config.num_beams > 1:
            raise ValueError("cache_implementation='static' does not support beam search (num_beams > 1): beams "
                             "reorder the cache, which a static cache cannot do in place; use the dynamic cache")
        max_cache_len = max(max_cache_length, getattr(generation_config, "max_cache_len", None) or 0)
        model_kwargs[CACHE_FIELD] = SelectiveRopeStaticCache(
            self.config, max_cache_len=max_cache_len,
            max_batch_size=batch_size * max(generation_config.num_return_sequences or 1, 1))

    def create_masks_for_generate(self, *, inputs_embeds: torch.Tensor, attention_mask=None, **kwargs):
        """What ``generate`` passes as the mask with a compileable (static) cache: the 2-D padding mask of this call's
        tokens only (our mixers mask their own states; no 4-D mask), so a compiled step sees one shape every step."""
        return None if attention_mask is None else attention_mask[:, -inputs_embeds.shape[1]:]

    def _prepare_position_ids_for_generation(self, inputs_tensor, model_kwargs):
        # generate() (transformers >= 5.10) builds position_ids from the mask when the caller passes none, then
        # extends them by one per step from the last column: after right padding or a row of padding only, that is
        # not the positions these models count, and forward refuses them. Our forward counts positions itself, so
        # generate builds none; position_ids the caller passes to generate still go through forward's checks.
        return None
