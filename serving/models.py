"""vLLM model classes serving our saved models: our own Hugging Face model runs vLLM's continuous batches.

Each engine step hands the model one flat batch of tokens from many requests (``query_start_loc`` marks where each
request's tokens start): decodes (one token) first, then prefills, some of them chunks of a longer prompt that
continue a state. Per step, :meth:`SelectiveRopeStateModel.forward`

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

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.model_executor.models.interfaces import HasInnerState, IsAttentionFree
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

from ..families import family_of_model_type
from ..modeling.cache import SelectiveRopeCache
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


class SelectiveRopeStateModel(nn.Module, HasInnerState, IsAttentionFree):
    """A saved causal LM of one family (``lm_class``), served as a state-only model (GLA, Gated DeltaNet)."""

    lm_class: type  # our causal-LM class for this architecture

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
        layout = self.state_layout(vllm_config)
        if layout.token_histories:
            raise ValueError(f"{config.model_type} layers keep per-token histories "
                             f"({', '.join(sorted(layout.token_histories))}): not a state-only model")
        self.states = [LayerStates(layout, vllm_config, f"{prefix}model.layers.{i}.states")
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
                out[begin:end] = self._run(embeds[begin:end], starts[first:last + 1] - begin,
                                           step.seq_lens[first:last], step.state_indices_tensor[first:last])
        return out

    def _run(self, embeds: torch.Tensor, offsets: torch.Tensor, seq_lens: torch.Tensor,
             slots: torch.Tensor) -> torch.Tensor:
        """Requests packed in ``embeds`` ``(T, D)`` at ``offsets`` ``(N + 1,)``, with ``seq_lens`` ``(N,)`` tokens
        each once this step is done, their states in ``slots`` ``(N,)`` -> ``(T, D)``."""
        slots = slots.long()
        fresh = seq_lens == offsets.diff()  # nothing computed before this step: a start, or a preempted restart
        cache = SelectiveRopeCache(self.config)
        for layer, states in zip(cache.layers, self.states):
            layer.commit(states.read(slots, fresh), num_new_tokens=0)
        hidden = self.model(inputs_embeds=embeds[None], cu_seqlens=offsets, past_key_values=cache,
                            use_cache=True).last_hidden_state[0]
        for layer, states in zip(cache.layers, self.states):
            states.write(slots, layer.states)
        return hidden

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


def _state_model(lm_class: type) -> type:
    return type(lm_class.__name__, (SelectiveRopeStateModel,), {"lm_class": lm_class, "__module__": __name__})


def _lm_class(name: str) -> type:
    import selective_rope

    return getattr(selective_rope, name)


SelectiveRopeGLAForCausalLM = _state_model(_lm_class("SelectiveRopeGLAForCausalLM"))
SelectiveRopeGatedDeltaNetForCausalLM = _state_model(_lm_class("SelectiveRopeGatedDeltaNetForCausalLM"))
