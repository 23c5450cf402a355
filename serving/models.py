"""vLLM model classes serving our saved models: our own Hugging Face model runs vLLM's continuous batches.

Each engine step hands the model one flat batch of tokens from many requests (``query_start_loc`` marks where each
request's tokens start): decodes (one token) first, then prefills, some of them chunks of a longer prompt that
continue a state. Per step, :meth:`SelectiveRopeServedModel.forward`

1. reads each request's states out of vLLM's state blocks (one :class:`LayerStates` per layer, its slots given by
   the step's metadata), zeros for a request that starts now (a new one, or a preempted one recomputing from its
   first token);
2. runs our base model (``SelectiveRopeModelBase.forward``) on the requests as packed sequences with those states as
   its cache: the same mixers, rotary module and kernels as ``generate()``. Decodes and prefills run as two calls,
   so one long prefill does not pad every decode to its length on the CPU path (``dispatch.keeps_packed``: kernels
   that take packed sequences, the fla/Triton path on a GPU, get them as they are);
3. writes the states the cache holds afterwards back into the blocks.

Which states a layer keeps is read off the mixer (:func:`.states.layer_states`), never listed here.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.model_executor.models.interfaces import HasInnerState, IsAttentionFree, IsHybrid
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

from selective_rope.families import family_of_model_type

from ..modeling.cache import SelectiveRopeCache
from ..modeling.layout import SequenceLayout
from . import HYBRID_MODEL_TYPES, served_families
from .states import StateLayout, layer_states


class LayerStates(nn.Module, MambaBase):
    """One layer's per-request running states in vLLM's state blocks: ``kv_cache[i]`` ``(num_blocks, *shape_i)`` for
    the ``i``-th entry of the layout (vLLM allocates and binds them). No parameters: vLLM finds it by its ``prefix``
    in the forward context, as it finds its own Mamba layers."""

    def __init__(self, layout: StateLayout, vllm_config: VllmConfig, prefix: str):
        super().__init__()
        self.layout, self.prefix = layout, prefix
        self.kv_cache: tuple[torch.Tensor, ...] = ()
        context = vllm_config.compilation_config.static_forward_context
        if prefix in context:
            raise ValueError(f"duplicate layer name: {prefix}")
        context[prefix] = self

    @property
    def mamba_type(self) -> MambaAttentionBackendEnum:
        # The plain state-slot metadata (decodes first, one slot per request); our own code runs the layer.
        return MambaAttentionBackendEnum.LINEAR

    def get_state_shape(self) -> tuple[tuple[int, ...], ...]:
        return self.layout.shapes

    def get_state_dtype(self) -> tuple[torch.dtype, ...]:
        return self.layout.dtypes

    def read(self, slots: torch.Tensor, fresh: torch.Tensor) -> dict[str, torch.Tensor]:
        """The states of the requests in ``slots`` ``(N,)``, zero where ``fresh`` ``(N,)`` (zero states are a
        sequence start for every mixer: empty histories, no recurrence, phase 0)."""
        states = {}
        for name, blocks in zip(self.layout.names, self.kv_cache):
            rows = blocks[slots]  # (N, *shape), a copy
            rows[fresh] = 0
            states[name] = rows
        return states

    def write(self, slots: torch.Tensor, states: dict[str, torch.Tensor]) -> None:
        for name, blocks in zip(self.layout.names, self.kv_cache):
            blocks[slots] = states[name].to(blocks.dtype)


class SelectiveRopeServedModel(nn.Module):
    """A saved causal LM of one family (``lm_class``) run on vLLM's batches; the subclasses say where the layers'
    states live (:class:`SelectiveRopeStateModel`, :class:`SelectiveRopeHybridModel`)."""

    lm_class: type  # our causal-LM class for this architecture
    has_inner_state = True

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        expected = self.lm_class.config_class.model_type
        if getattr(config, "model_type", None) != expected:
            raise ValueError(f"{type(self).__name__} serves {expected} models, but this model's config has "
                             f"model_type {getattr(config, 'model_type', None)!r}: its config.json names the wrong "
                             "architecture for its family")
        self.config = config
        # Our own model (weights loaded by load_weights): `model` and `lm_head`, the names of its checkpoints.
        lm = self.lm_class(config)
        self.model, self.lm_head = lm.model, lm.lm_head
        self.layout = self.state_layout(vllm_config)
        # Not sub-modules: they hold no weights, and vLLM finds them by their prefix.
        self.states = [LayerStates(self.layout, vllm_config, f"{prefix}model.layers.{i}.states")
                       for i in range(config.num_hidden_layers)]

    @classmethod
    def state_layout(cls, vllm_config: VllmConfig) -> StateLayout:
        model_config = vllm_config.model_config
        mixer_class = family_of_model_type(model_config.hf_config.model_type).model_class.mixer_class
        return layer_states(mixer_class, model_config.hf_config, model_config.dtype)

    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: VllmConfig):
        return cls.state_layout(vllm_config).shapes

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: VllmConfig):
        return cls.state_layout(vllm_config).dtypes

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embeddings(input_ids)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, intermediate_tensors=None,
                inputs_embeds: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        """``input_ids`` ``(T,)`` (or ``inputs_embeds`` ``(T, D)``) of the step's requests, one after another ->
        the final hidden states ``(T, D)``. Positions are not read: our models count them (the phase)."""
        embeds = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
        metadata = get_forward_context().attn_metadata
        if metadata is None:  # a profiling run, with no state blocks: no state in, none kept
            return self.model(inputs_embeds=embeds[None], use_cache=False).last_hidden_state[0]
        step = metadata[self.states[0].prefix]  # every layer reads the same slots
        out = torch.zeros_like(embeds)
        starts = step.query_start_loc
        groups = ((0, step.num_decodes), (step.num_decodes, step.num_decodes + step.num_prefills))
        for first, last in groups:  # decodes, then prefills (vLLM orders the batch so)
            if last > first:
                begin, end = int(starts[first]), int(starts[last])
                requests = Requests(first, last, begin, end, starts[first:last + 1] - begin,
                                    step.seq_lens[first:last], step.state_indices_tensor[first:last].long())
                out[begin:end] = self._run(embeds[begin:end], requests, metadata)
        return out

    def _run(self, embeds: torch.Tensor, requests: Requests, metadata: dict) -> torch.Tensor:
        """The ``requests`` packed in ``embeds`` ``(T, D)`` -> ``(T, D)``, their states read before and written
        after."""
        cache = SelectiveRopeCache(self.config)
        for i, layer in enumerate(cache.layers):
            previous, histories = self._read(i, requests, metadata)
            layer.commit(previous, num_new_tokens=0, token_states=histories)
        lengths = requests.offsets.diff()
        if bool((lengths == lengths[0]).all()):  # e.g. decodes: one dense batch (N, L, D), generate()'s own path
            hidden = self.model(inputs_embeds=embeds.view(len(lengths), -1, embeds.shape[-1]), past_key_values=cache,
                                use_cache=True).last_hidden_state.flatten(0, 1)
        else:
            hidden = self.model(inputs_embeds=embeds[None], cu_seqlens=requests.offsets, past_key_values=cache,
                                use_cache=True).last_hidden_state[0]
        for i, layer in enumerate(cache.layers):
            self._write(i, requests, metadata, layer.states)
        return hidden

    def _read(self, layer: int, requests: Requests, metadata: dict) -> tuple[dict[str, torch.Tensor], tuple]:
        """Layer ``layer``'s states of ``requests`` before this step (as our cache holds them) and the names of the
        per-token histories among them."""
        return self.states[layer].read(requests.slots, requests.fresh), ()

    def _write(self, layer: int, requests: Requests, metadata: dict, states: dict[str, torch.Tensor]) -> None:
        self.states[layer].write(requests.slots, states)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states)  # (T, vocab), our own head (one device: no gathering across ranks)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Our checkpoint's tensors by their names (``model.*``, ``lm_head.weight``; a tied head shares the
        embedding's). Returns the names loaded; a name this model does not have is refused."""
        targets = dict(self.named_parameters())
        targets.update(self.named_buffers())
        loaded = set()
        for name, tensor in weights:
            if name not in targets:
                raise ValueError(f"checkpoint tensor {name!r} is not a parameter of {type(self).__name__}: the model "
                                 "directory holds another family's or another version's weights")
            with torch.no_grad():
                targets[name].copy_(tensor.to(targets[name].dtype))
            loaded.add(name)
        if self.config.tie_word_embeddings:
            loaded.add("lm_head.weight")
        return loaded


class SelectiveRopeStateModel(SelectiveRopeServedModel, HasInnerState, IsAttentionFree):
    """A state-only family (GLA, Gated DeltaNet): every state of a layer is a running state, in vLLM's state
    blocks."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        if self.layout.token_histories:
            raise ValueError(f"{self.config.model_type} layers keep per-token histories "
                             f"({', '.join(sorted(self.layout.token_histories))}): not a state-only model")


@dataclass
class Requests:
    """The requests ``first:last`` of a step's batch, their tokens ``begin:end`` of its flat token axis."""

    first: int
    last: int
    begin: int
    end: int
    offsets: torch.Tensor  # (N + 1,) where each request's tokens start, from 0
    seq_lens: torch.Tensor  # (N,) tokens of each request once this step is done
    slots: torch.Tensor  # (N,) int64, each request's state block

    @property
    def contexts(self) -> torch.Tensor:
        """``(N,)`` tokens computed before this step (0: a start, or a preempted request recomputing)."""
        return self.seq_lens - self.offsets.diff()

    @property
    def fresh(self) -> torch.Tensor:
        return self.contexts == 0


class PagedTimeline:
    """One FoX layer's per-token histories in pages: keys and values in vLLM's paged K/V cache (bound to the layer's
    ``Attention``, whose kernel is never called: no stock backend adds FoX's per-key bias), every other history (the
    log forget gates) in float32 pages of our own with the same block ids, so a forget-gate sum never passes through
    the K/V dtype. Pages are read through the step's block table and written at its slot mapping."""

    def __init__(self, attention: nn.Module):
        self.attention = attention
        self.side_pages: dict[str, torch.Tensor] = {}

    def _key_value_pages(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(num_blocks, Hk, block_size, D)`` each, views of the layer's K/V pages as the CPU attention backend
        lays them out and reads them itself: ``(num_blocks, Hk, block_size, 2 * D)``, viewed as ``(num_blocks, Hk,
        2 * block_size, D)`` and halved along the token axis."""
        num_blocks, num_kv_heads, block_size, _ = self.attention.kv_cache.shape
        return self.attention.kv_cache.view(num_blocks, num_kv_heads, 2 * block_size, -1).chunk(2, dim=2)

    def _pages(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """``(num_blocks, block_size, *inner)`` float32 pages for the history ``name``, made on first use."""
        pages = self.side_pages.get(name)
        if pages is None:
            keys, _ = self._key_value_pages()
            pages = self.side_pages[name] = torch.zeros(keys.shape[0], keys.shape[2], *like.shape[2:],
                                                        dtype=torch.float32, device=keys.device)
        return pages

    def read(self, names: Iterable[str], blocks: torch.Tensor, contexts: torch.Tensor) -> dict[str, torch.Tensor]:
        """The histories of requests whose pages are ``blocks`` ``(N, max_blocks)``, ``contexts`` ``(N,)`` tokens
        each: right-padded ``(N, C, ...)`` (``C`` the longest) with ``valid`` ``(N, C)`` marking real slots, as our
        cache keeps a padded timeline; ``{}`` when no request has one."""
        longest = int(contexts.max())
        if longest == 0:
            return {}
        keys, values = self._key_value_pages()
        position = torch.arange(longest, device=blocks.device)
        block, offset = blocks[:, position // keys.shape[2]].long(), position % keys.shape[2]  # (N, C), (C,)
        valid = position < contexts[:, None]  # (N, C)
        histories = {"valid": valid}
        for name in names:
            if name in ("key", "value"):
                pages = keys if name == "key" else values
                rows = pages[block, :, offset]  # (N, C, Hk, D)
            else:
                pages = self.side_pages[name]
                rows = pages[block, offset]  # (N, C, *inner)
            histories[name] = rows * valid.view(*valid.shape, *[1] * (rows.dim() - 2)).to(rows.dtype)
        return histories

    def write(self, histories: dict[str, torch.Tensor], names: Iterable[str], contexts_longest: int,
              offsets: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store this step's tokens: columns ``contexts_longest:`` of each history ``(N, C + L, ...)``, the rows of the
        requests packed at ``offsets``, at the slots ``slot_mapping`` ``(T,)``."""
        keys, values = self._key_value_pages()
        layout = SequenceLayout.from_cu_seqlens(offsets, total=slot_mapping.numel())
        slots = slot_mapping.long()
        block, offset = slots // keys.shape[2], slots % keys.shape[2]
        for name in names:
            tokens = layout.from_rows(histories[name][:, contexts_longest:])[0]  # (T, ...)
            if name in ("key", "value"):
                pages = keys if name == "key" else values
                pages[block, :, offset] = tokens.to(pages.dtype)
            else:
                self._pages(name, histories[name])[block, offset] = tokens.float()


class SelectiveRopeHybridModel(SelectiveRopeServedModel, IsHybrid):
    """FoX: keys and values in vLLM's paged K/V cache (one ``Attention`` per layer allocates them), the log forget
    gates in float32 pages beside them (:class:`PagedTimeline`), and the running states (Selective RoPE phase, token
    shifts) in state blocks."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        config = self.config
        missing = {"key", "value"} - self.layout.token_histories
        if missing:
            raise ValueError(f"{config.model_type} layers keep no {', '.join(sorted(missing))} history: not an "
                             "attention model")
        self.timelines = [
            PagedTimeline(Attention(config.num_attention_heads, config.head_dim, config.head_dim ** -0.5,
                                    num_kv_heads=config.num_key_value_heads, cache_config=vllm_config.cache_config,
                                    prefix=f"{prefix}model.layers.{i}.attn.attn"))
            for i in range(config.num_hidden_layers)
        ]
        # The K/V pages are the attention backend's: it must take the head dim (on the CPU 32, 64, 80, 96, ...), or the
        # engine would fail at its first step, deep in the backend.
        backend = self.timelines[0].attention.attn_backend
        if not backend.supports_head_size(config.head_dim):
            raise ValueError(f"vLLM's {backend.get_name()} attention backend, which keeps FoX's keys and values, does "
                             f"not take head_dim={config.head_dim}; it takes {backend.get_supported_head_sizes()}")

    def _read(self, layer, requests, metadata):
        running = self.states[layer].read(requests.slots, requests.fresh)
        pages = metadata[self.timelines[layer].attention.layer_name]
        histories = self.timelines[layer].read(self.layout.token_histories,
                                               pages.block_table[requests.first:requests.last], requests.contexts)
        return {**running, **histories}, tuple(histories)

    def _write(self, layer, requests, metadata, states):
        self.states[layer].write(requests.slots, states)
        pages = metadata[self.timelines[layer].attention.layer_name]
        self.timelines[layer].write(states, self.layout.token_histories, int(requests.contexts.max()),
                                    requests.offsets, pages.slot_mapping[requests.begin:requests.end])


def _served_model(lm_class: type) -> type:
    base = SelectiveRopeHybridModel if lm_class.config_class.model_type in HYBRID_MODEL_TYPES else \
        SelectiveRopeStateModel
    return type(lm_class.__name__, (base,), {"lm_class": lm_class, "__module__": __name__})


# One vLLM class per family, named as the family's causal LM (the architecture in its config.json).
for _family in served_families():
    globals()[_family.lm_class.__name__] = _served_model(_family.lm_class)
