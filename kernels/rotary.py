"""Selective RoPE's rotation on the resolved backend: our PyTorch op (``rotary_torch``) or our Triton kernels
(``rotary_triton``, imported lazily through ``dispatch.triton_rotary``)."""

from __future__ import annotations

import functools

import torch

from .dispatch import triton_rotary
from .rotary_torch import selective_rotary as selective_rotary_torch


def selective_rotary(q, k, increment, temperature, initial_phase=None, *, cu_seqlens=None, backend: str = "torch"):
    """``rotary_torch.selective_rotary`` (same arguments and results) on the resolved ``backend``; packed sequences
    (``cu_seqlens``, Triton only) as in ``rotary_triton.selective_rotary_triton``."""
    if backend == "triton":
        return triton_rotary().selective_rotary_triton(q, k, increment, temperature, initial_phase,
                                                       cu_seqlens=cu_seqlens)
    if cu_seqlens is not None:
        raise ValueError("cu_seqlens needs the Triton rotary kernel; the torch op takes dense right-padded rows")
    return selective_rotary_torch(q, k, increment, temperature, initial_phase)


def single_token_step_applies(seq_len: int, cu_seqlens: torch.Tensor | None) -> bool:
    """Whether a rotary call takes a single-token step (decoding: one token per row, no packing, no gradients; the
    steps have no backward): on the torch backend the rotary module's own torch step, on the Triton backend the fused
    ``selective_rotary_decode`` (Selective RoPE and RoPE)."""
    return seq_len == 1 and cu_seqlens is None and not torch.is_grad_enabled()


def selective_rotary_decode(*args, **kwargs):
    """The fused single-token step (Triton only): see ``rotary_triton.selective_rotary_decode_triton``."""
    return triton_rotary().selective_rotary_decode_triton(*args, **kwargs)


def selective_rotary_decode_from_input(*args, **kwargs):
    """The fused single-token step with the default phase path's inputs computed in the same launch (Triton only;
    ``None`` where the call is not plain eager): see ``rotary_triton.selective_rotary_decode_from_input_triton``."""
    return triton_rotary().selective_rotary_decode_from_input_triton(*args, **kwargs)


@functools.lru_cache(maxsize=None)
def unit_step(device: torch.device) -> torch.Tensor:
    """RoPE's phase projection for the fused decode step: one float64 1 on ``device``, which the step broadcasts
    (stride 0) to every row, head and frequency (made once per device and never written, so a decoding step
    launches no fill)."""
    return torch.ones((), dtype=torch.float64, device=device)
