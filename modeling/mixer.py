"""The contract between the shared decoder block and a family's mixer, and the per-layer state they exchange.

A family provides a config class and a mixer class (:class:`Mixer`); everything else (block, base model, LM head,
cache, Hub code) is shared and never reads the family's own fields. Calls go one way: the base model hands each block
its rows and a :class:`LayerState`, the block calls the mixer, the mixer calls the kernels. The base model commits the
state into the cache afterwards (``use_cache``); the mixer never sees the cache itself.
"""

from __future__ import annotations

from typing import Protocol

import torch

from .cache import SelectiveRopeCacheLayer, append_tokens


class LayerState:
    """One layer's decoding state during one forward call: what the cache held before (read with ``get`` / ``in``)
    and what the mixer leaves for the next call (``set`` for running states, ``extend`` for per-token histories).

    Tensors are batch first. Names are flat strings; a sub-module keeps its own entries under a prefix through
    :meth:`scope` (the rotary module's ``phase`` is the layer's ``rotary.phase``), so the cache sees one flat dict.

    Args:
        previous: the layer's cached tensors (``None``: a sequence start).
        keep: whether the caller keeps the new state (``use_cache``): a mixer skips work that only produces state
            (final recurrent states) when it is False.
        output_attentions: whether the caller wants the attention weights: a mixer with ``has_attention_weights``
            then leaves them in ``attentions``, ``(B, H, T, T_keys)`` in the caller's layout: its rows' weights mapped
            by ``attention_layout`` (:class:`~.layout.AttentionLayout`; None: rows are the caller's grid).
        layer: the cache layer the state is committed to, which decides how histories grow (``None``: appended).
    """

    def __init__(self, previous: dict[str, torch.Tensor] | None = None, *, keep: bool = False,
                 output_attentions: bool = False, attention_layout=None,
                 layer: SelectiveRopeCacheLayer | None = None, prefix: str = "",
                 _shared: tuple[dict, dict, set] | None = None):
        # (previous, new, token histories) shared between a state and its scopes.
        self._previous, self.new, self.token_histories = _shared or (dict(previous or {}), {}, set())
        self.keep = keep
        self.output_attentions = output_attentions
        self.attention_layout = attention_layout
        self.attentions: torch.Tensor | None = None
        self._layer = layer
        self._prefix = prefix

    @property
    def fixed_length(self) -> bool:
        """Whether per-token histories are fixed-length buffers (a static cache, for compiled decoding): after the
        prefill, ``extend`` then returns the whole buffer, whose slots after this call's tokens are unwritten, and
        the mixer must mask them."""
        return self._layer is not None and self._layer.fixed_length

    @property
    def in_place(self) -> bool:
        """Whether the cache's running-state tensors (``get``) are also the next state's (a static cache, kept): the
        kernels then write the new recurrent states, convolution histories and phase into them, and ``set`` hands the
        same tensors back. A dynamic cache's states are never written: each call leaves new tensors."""
        return self.keep and self.fixed_length

    def _name(self, name: str) -> str:
        return self._prefix + name

    def __contains__(self, name: str) -> bool:
        return self._name(name) in self._previous

    def get(self, name: str) -> torch.Tensor | None:
        """The cached tensor ``name`` from before this call (``None`` at a sequence start)."""
        return self._previous.get(self._name(name))

    def previous(self) -> dict[str, torch.Tensor]:
        """Every cached tensor of this scope, by its name in the scope."""
        start = len(self._prefix)
        return {name[start:]: t for name, t in self._previous.items() if name.startswith(self._prefix)}

    def set(self, name: str, tensor: torch.Tensor) -> None:
        """Leave a running state (a recurrence, a convolution history, a phase) for the next call."""
        self.new[self._name(name)] = tensor

    def update(self, tensors: dict[str, torch.Tensor]) -> None:
        for name, tensor in tensors.items():
            self.set(name, tensor)

    def extend(self, name: str, tokens: torch.Tensor) -> torch.Tensor:
        """Append ``tokens`` ``(B, T, ...)`` to the per-token history ``name`` ``(B, T_seen, ...)`` and return the
        whole history ``(B, T_seen + T, ...)`` (the cache's :func:`append_tokens`: in place where it has room). The
        cache can crop these entries, and only these. With a static cache (``fixed_length``), see
        ``SelectiveRopeStaticCacheLayer.extend``."""
        cached = self.get(name)
        history = append_tokens(cached, tokens) if self._layer is None else self._layer.extend(
            self._name(name), cached, tokens)
        self.set(name, history)
        self.token_histories.add(self._name(name))
        return history

    def scope(self, prefix: str) -> LayerState:
        """A view of the entries under ``prefix.``, read and written by their names without the prefix."""
        return LayerState(keep=self.keep, layer=self._layer, prefix=f"{self._prefix}{prefix}.",
                          _shared=(self._previous, self.new, self.token_histories))


class Mixer(Protocol):
    """A family's sequence mixer, the only family-specific module in a decoder block.

    Built as ``mixer_class(config, layer_idx)``; owns a ``rotary`` (:class:`~.rotary.SelectiveRotaryEmbedding`).
    ``hidden_states`` are right-padded rows ``(N, L, D)`` with ``lengths`` ``(N,)`` real tokens each (``None``: every
    row is full; see :mod:`.layout`), or, where the kernels take packed sequences (``dispatch.keeps_packed``), one row
    ``(1, total, D)`` with ``cu_seqlens`` ``(N + 1,)``: states are then still one row per sequence. ``backend`` is
    ``"torch"``, ``"torch+c"`` or ``"triton"``, resolved once per model call (``dispatch.resolve_backend``). Returns
    ``(N, L, D)`` (or ``(1, total, D)``); the new state goes into ``state``.

    A softmax-attention mixer sets ``has_attention_weights = True`` and, when ``state.output_attentions``, leaves its
    weights in ``state.attentions`` (rows only: the base model never hands it packed sequences then).
    """

    rotary: torch.nn.Module
    has_attention_weights: bool  # (optional, False when absent) see above

    def __call__(self, hidden_states: torch.Tensor, state: LayerState, *, lengths: torch.Tensor | None,
                 cu_seqlens: torch.Tensor | None, backend: str) -> torch.Tensor: ...
