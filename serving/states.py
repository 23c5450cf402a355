"""Which per-request states a family's layer keeps, read off the mixer itself (no second copy of its bookkeeping).

A mixer leaves its decoding state in a :class:`~selective_rope.modeling.mixer.LayerState`: running states (``set``:
recurrences, convolution histories, the Selective RoPE phase) and per-token histories (``extend``: FoX's keys,
values and log forget gates). :func:`layer_states` runs one layer's mixer on one token and reads back each entry's
name, shape and dtype, exactly as the model's own cache would hold them (float64 phase included).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..modeling.mixer import LayerState


@dataclass(frozen=True)
class StateLayout:
    """One layer's states: ``running`` ``(name, shape without the batch dim, dtype)``, ordered by decreasing
    element size (so each state starts aligned inside vLLM's byte page), and the names of the per-token histories."""

    running: tuple[tuple[str, tuple[int, ...], torch.dtype], ...]
    token_histories: frozenset[str]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _, _ in self.running)

    @property
    def shapes(self) -> tuple[tuple[int, ...], ...]:
        return tuple(shape for _, shape, _ in self.running)

    @property
    def dtypes(self) -> tuple[torch.dtype, ...]:
        return tuple(dtype for _, _, dtype in self.running)


def layer_states(mixer_class: type, config, dtype: torch.dtype) -> StateLayout:
    """The states one layer of ``mixer_class`` keeps for a model of ``config`` in ``dtype``.

    The mixer is built without initialising weights (its shapes, not its values, matter) and runs one token on the
    pure PyTorch path; every layer of a family keeps the same states."""
    with torch.device("meta"):
        mixer = mixer_class(config, 0)
    mixer = mixer.to_empty(device="cpu").to(dtype)  # the rotary module keeps float32 (its own _apply)
    with torch.no_grad():
        for tensor in (*mixer.parameters(), *mixer.buffers()):
            tensor.zero_()
        state = LayerState(keep=True)
        mixer(torch.zeros(1, 1, config.hidden_size, dtype=dtype), state, lengths=None, cu_seqlens=None,
              backend="torch")
    running = [(name, tuple(t.shape[1:]), t.dtype) for name, t in state.new.items()
               if name not in state.token_histories]
    running.sort(key=lambda entry: -entry[2].itemsize)
    return StateLayout(tuple(running), frozenset(state.token_histories))
