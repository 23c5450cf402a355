"""What every family shares: the pre-norm block, the base model and the causal-LM head.

A family provides its config class and its mixer (``mixer_class``); the mixer maps
``(hidden_states (N, L, D), lengths, state) -> (output (N, L, D), new_state)`` over right-padded rows (see
:mod:`.layout`) and keeps its decoding state in a flat dict of tensors (batch first). Its ``token_states`` names the
entries that are per-token histories ``(N, T_seen, ...)`` (FoX's keys and values): only those can be cropped.
"""

from __future__ import annotations

import os
import sys

import torch
from huggingface_hub import HfApi, ModelCard
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.utils import logging
from transformers.utils.generic import can_return_tuple

from .cache import SelectiveRopeCache
from .layers import GatedMLP, RMSNorm, mlp_width
from .layout import SequenceLayout
from .model_card import render_model_card, template_texts
from .remote_code import bundle_auto_map, write_code_bundle
from .rotary import SelectiveRotaryEmbedding

logger = logging.get_logger(__name__)


def substate(state: dict[str, torch.Tensor] | None, prefix: str) -> dict[str, torch.Tensor]:
    """The entries of ``state`` under ``prefix.``, without the prefix."""
    prefix = prefix + "."
    return {name[len(prefix):]: t for name, t in (state or {}).items() if name.startswith(prefix)}


def with_prefix(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {f"{prefix}.{name}": t for name, t in state.items()}


class SelectiveRopeDecoderBlock(GradientCheckpointingLayer):
    """``x + mixer(norm(x))`` then ``x + mlp(norm(x))``."""

    def __init__(self, config, layer_idx: int, mixer_class: type[nn.Module]):
        super().__init__()
        self.layer_idx = layer_idx
        self.attn_norm = RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.attn = mixer_class(config, layer_idx)
        self.mlp_norm = RMSNorm(config.hidden_size, eps=config.norm_eps)
        # GLA/GDN size the MLP from hidden_ratio (flash-linear-attention's rule); FoX gives intermediate_size and
        # mlp_bias as Llama does.
        width = mlp_width(config.hidden_size, getattr(config, "hidden_ratio", None), config.intermediate_size)
        self.mlp = GatedMLP(config.hidden_size, width, bias=getattr(config, "mlp_bias", False))

    def forward(self, hidden_states: torch.Tensor, lengths: torch.Tensor | None = None,
                state: dict[str, torch.Tensor] | None = None, use_cache: bool = False):
        mixed, new_state = self.attn(self.attn_norm(hidden_states), lengths=lengths, state=state, use_cache=use_cache)
        hidden_states = hidden_states + mixed
        hidden_states = hidden_states + self.mlp(self.mlp_norm(hidden_states))
        return hidden_states, new_state


class SelectiveRopePreTrainedModel(PreTrainedModel):
    """Weight initialisation and the transformers flags shared by every family."""

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

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)  # Linear / Conv1d: N(0, initializer_range); Embedding; RMSNorm ones
        if isinstance(module, SelectiveRotaryEmbedding) and module.mode != "nope":
            init.copy_(module.temperature, module.initial_temperature())
            if getattr(module, "phase_bias", None) is not None:
                init.zeros_(module.phase_bias)
        elif hasattr(module, "init_custom_parameters"):  # our modules with non-standard parameters
            module.init_custom_parameters()

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        # generate() must not build a DynamicCache for us: our forward creates a SelectiveRopeCache.
        return False

    def _auto_classes(self) -> tuple[type, type]:
        """(base model class, causal-LM class) of this family."""
        raise NotImplementedError

    def save_pretrained(self, save_directory: str | os.PathLike, *args, is_main_process: bool = True,
                        model_card: bool | dict | ModelCard | str | None = None, **kwargs):
        """transformers' ``save_pretrained``, plus the modeling code as flat files and the ``auto_map`` naming
        AutoConfig, AutoModel and AutoModelForCausalLM, so the directory also loads with ``trust_remote_code=True``
        where ``selective_rope`` is not installed. The code is written first so ``push_to_hub=True`` uploads it.

        ``model_card``: also write this model's card as ``README.md`` (``True``: rendered from the family's template
        with the directory's name; a dict: arguments of :meth:`model_card`; a ``ModelCard`` or markdown: as given).
        Not with ``push_to_hub=True``, which uploads transformers' generic card: use :meth:`push_to_hub` instead."""
        if model_card not in (None, False) and kwargs.get("push_to_hub"):
            raise ValueError("save_pretrained(push_to_hub=True) uploads transformers' generic model card; to upload "
                             "this model's card use model.push_to_hub(repo_id, model_card=...)")
        base_class, lm_class = self._auto_classes()
        self.config.auto_map = bundle_auto_map(lm_class, type(self.config), base_class)
        if is_main_process:
            os.makedirs(save_directory, exist_ok=True)
            write_code_bundle(save_directory, type(self).__module__, extra_files=template_texts())
        result = super().save_pretrained(save_directory, *args, is_main_process=is_main_process, **kwargs)
        if model_card not in (None, False) and is_main_process:
            name = os.path.basename(os.path.normpath(os.fspath(save_directory)))
            self._resolve_card(model_card, name).save(os.path.join(save_directory, "README.md"))
        return result

    def push_to_hub(self, repo_id: str, *, model_card: bool | dict | ModelCard | str = True, **kwargs):
        """Upload config, safetensors weights and the modeling code (transformers' ``push_to_hub``, through our
        :meth:`save_pretrained`), then this model's card as ``README.md``.

        transformers puts a generic card into its upload (or keeps the card the repository already has), so ours
        follows in a second commit to the same branch or pull request.

        Args:
            model_card: ``True`` (default): rendered from the family's template (:meth:`model_card`) for ``repo_id``;
                a dict: arguments of :meth:`model_card` (``model_name``, ``license``, ``base_model``,
                ``base_model_relation``, ``provenance``); a ``huggingface_hub.ModelCard`` or markdown text: uploaded as
                given; ``False``: only transformers' upload (the repository's existing card is kept).
            kwargs: transformers' ``push_to_hub`` arguments (``commit_message``, ``private``, ``token``,
                ``revision``, ``create_pr``, ``max_shard_size``, ``tags``; tags are added to our card too).

        Returns:
            The ``CommitInfo`` of the last commit (the card's); with ``create_pr=True``, that of the pull request
            (``pr_url``, ``pr_revision``), which received both commits.
        """
        commit = super().push_to_hub(repo_id, **kwargs)
        if model_card is False:
            return commit
        repo_id = commit.repo_url.repo_id  # as the Hub names it (namespace included)
        tags = kwargs.get("tags") or []
        card = self._resolve_card(model_card, repo_id, [*(self.model_tags or []),
                                                        *([tags] if isinstance(tags, str) else tags)])
        # With create_pr=True the card joins transformers' pull request, or opens one if transformers had nothing new
        # to upload (then it made no commit and returned the branch's head).
        card_commit = HfApi(endpoint=commit.repo_url.endpoint).upload_file(
            path_or_fileobj=str(card).encode(), path_in_repo="README.md", repo_id=repo_id,
            token=kwargs.get("token"), revision=commit.pr_revision or kwargs.get("revision"),
            create_pr=bool(kwargs.get("create_pr")) and commit.pr_revision is None,
            commit_message="Add the selective-rope model card",
        )
        return commit if commit.pr_url else card_commit

    def _resolve_card(self, model_card, repo_id: str, tags: list[str] | None = None) -> ModelCard:
        if model_card is True:
            card = self.model_card(repo_id)
        elif isinstance(model_card, dict):
            card = self.model_card(repo_id, **model_card)
        elif isinstance(model_card, ModelCard):
            card = model_card
        elif isinstance(model_card, str):
            card = ModelCard(model_card)
        else:
            raise TypeError(f"model_card must be True, False, a dict of model_card() arguments, a ModelCard or "
                            f"markdown text; got {type(model_card).__name__}")
        if tags:
            card.data.tags = list(dict.fromkeys([*(card.data.tags or []), *tags]))
        return card

    def model_card(self, repo_id: str = "path/to/model", **card_info):
        """This model's card (a ``huggingface_hub.ModelCard``) from its family's template in ``model_cards/``.

        ``card_info``: ``model_name``, ``license`` (default ``apache-2.0``; required with ``base_model``: a model
        made from another one is under its license), ``base_model`` (a Hub id), ``base_model_relation``,
        ``provenance`` (markdown for "How it was made"). Save it with ``card.save(directory + "/README.md")``.
        """
        return render_model_card(self.config, repo_id=repo_id, num_parameters=self.num_parameters(), **card_info)


class SelectiveRopeModelBase(SelectiveRopePreTrainedModel):
    """Embeddings -> blocks -> final norm. Subclasses set ``config_class`` and ``mixer_class``."""

    mixer_class: type[nn.Module]

    def __init__(self, config):
        super().__init__(config)
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList(
            SelectiveRopeDecoderBlock(config, i, self.mixer_class) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embeddings

    def _auto_classes(self) -> tuple[type, type]:
        # Naming convention of every family module: SelectiveRopeXModel next to SelectiveRopeXForCausalLM.
        lm_name = type(self).__name__.removesuffix("Model") + "ForCausalLM"
        return type(self), getattr(sys.modules[type(self).__module__], lm_name)

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embeddings = value

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        past_key_values: SelectiveRopeCache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        cu_seqlens: torch.LongTensor | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        """
        Args:
            input_ids: ``(B, T)``; or ``inputs_embeds``: ``(B, T, D)``.
            attention_mask: ``(B, T_past + T)`` or ``(B, T)`` padding mask (1 = real token, padding anywhere). Only
                its last ``T`` columns are read: earlier tokens live in the cache.
            past_key_values: a :class:`SelectiveRopeCache` to continue from (created when ``use_cache`` and None).
            cu_seqlens: packed sequences: ``input_ids`` of shape ``(1, total)`` and offsets ``[0, ..., total]``; each
                sequence gets exactly the outputs it has alone (the cache then holds one row per sequence).
        """
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        if use_cache is None:  # in training the final states would only be thrown away
            use_cache = self.config.use_cache and not self.training
        if self.gradient_checkpointing and self.training and use_cache:
            logger.warning_once("use_cache=True is incompatible with gradient checkpointing; setting use_cache=False")
            use_cache = False
        if past_key_values is not None and not isinstance(past_key_values, SelectiveRopeCache):
            raise TypeError(f"past_key_values must be a SelectiveRopeCache (these models carry recurrent state), "
                            f"got {type(past_key_values).__name__}")
        if use_cache and past_key_values is None:
            past_key_values = SelectiveRopeCache(self.config)

        hidden_states = self.embeddings(input_ids) if inputs_embeds is None else inputs_embeds
        layout = self._layout(hidden_states.shape[:2], attention_mask, cu_seqlens)
        rows = hidden_states if layout is None else layout.to_rows(hidden_states)  # (N, L, D)
        lengths = None if layout is None else layout.lengths
        restore = (lambda x: x) if layout is None else layout.from_rows
        self._check_cache_batch(past_key_values, rows.shape[0])

        all_hidden_states = [] if output_hidden_states else None
        for layer_idx, block in enumerate(self.layers):
            if all_hidden_states is not None:
                all_hidden_states.append(restore(rows))
            state = past_key_values.layers[layer_idx].states if past_key_values is not None else None
            rows, new_state = block(rows, lengths=lengths, state=state, use_cache=use_cache)
            if use_cache:
                past_key_values.layers[layer_idx].set(new_state, num_new_tokens=hidden_states.shape[1],
                                                      token_states=block.attn.token_states)
        hidden_states = restore(self.norm(rows))
        if all_hidden_states is not None:
            all_hidden_states.append(hidden_states)

        return BaseModelOutputWithPast(
            last_hidden_state=hidden_states,
            past_key_values=past_key_values if use_cache else None,
            hidden_states=tuple(all_hidden_states) if all_hidden_states is not None else None,
        )

    @staticmethod
    def _check_cache_batch(cache: SelectiveRopeCache | None, rows: int) -> None:
        states = cache.layers[0].states if cache is not None and len(cache.layers) else {}
        cached_rows = next(iter(states.values())).shape[0] if states else rows
        if cached_rows != rows:
            raise ValueError(f"past_key_values holds {cached_rows} sequences but the input has {rows} "
                             "(with cu_seqlens, one per packed sequence)")

    @staticmethod
    def _layout(grid, attention_mask, cu_seqlens) -> SequenceLayout | None:
        batch, seq_len = grid
        if cu_seqlens is not None:
            if attention_mask is not None:
                raise ValueError("pass either cu_seqlens (packed sequences) or attention_mask (padding), not both")
            if batch != 1:
                raise ValueError(f"packed sequences (cu_seqlens) need a batch of 1, got {batch}")
            return SequenceLayout.from_cu_seqlens(cu_seqlens, total=seq_len)
        if attention_mask is None:
            return None
        if attention_mask.dim() != 2 or attention_mask.shape[0] != batch or attention_mask.shape[1] < seq_len:
            raise ValueError(f"attention_mask must be a 2-D padding mask (B, T_past + T) with B={batch}, "
                             f"T={seq_len}; got shape {tuple(attention_mask.shape)}")
        return SequenceLayout.from_attention_mask(attention_mask[:, -seq_len:])


class SelectiveRopeForCausalLMBase(SelectiveRopePreTrainedModel, GenerationMixin):
    """Language-model head over a family's base model. Subclasses set ``config_class`` and ``model_class``."""

    model_class: type[SelectiveRopeModelBase]
    _tied_weights_keys = {"lm_head.weight": "model.embeddings.weight"}

    def __init__(self, config):
        super().__init__(config)
        self.model = self.model_class(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def _auto_classes(self) -> tuple[type, type]:
        return self.model_class, type(self)

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        past_key_values: SelectiveRopeCache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        cu_seqlens: torch.LongTensor | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """``labels`` ``(B, T)`` (-100 = ignored) gives the shifted next-token loss through ``self.loss_function``,
        which honours Trainer's ``num_items_in_batch``. ``logits_to_keep`` keeps only the last N positions."""
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            output_hidden_states=output_hidden_states,
            cu_seqlens=cu_seqlens,
        )
        hidden_states = outputs.last_hidden_state
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden_states[:, keep, :])
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            past_key_values=outputs.past_key_values,
            hidden_states=outputs.hidden_states,
        )
