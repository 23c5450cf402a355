"""Selective RoPE's cumulative phase and rotation, pure PyTorch (the reference the Triton kernel must match).

Precision. The phase ``θ_t`` is a running sum over the whole sequence: after 32k tokens of order-1 increments it is
~10⁴, where a float32 step is ~10⁻³ rad, and a float32 running sum drifts much further (cached decoding adds one
increment at a time, a prefill sums a whole sequence at once: they disagree). So the phase is carried in float64
(``phase_dtype``), and each angle ``τ_i θ_t`` is reduced modulo 2π in float64 before it is rounded to float32 for
sin/cos (``rotary_angles``): prefill, decoding and the Triton kernels then compute the same angles from the same
phase, to ~1e-6 rad at any length. The increments are float32 here; ``SelectiveRotaryEmbedding`` computes them in
float64 and rounds them once, so that a decoding step and a prefill give the same ones.
"""

from __future__ import annotations

import math

import torch

TWO_PI = 2 * math.pi


def phase_dtype(device: torch.device | str) -> torch.dtype:
    """float64, except on Apple's MPS, which has no float64: there the phase is float32 (and drifts at long context,
    see the module docstring)."""
    return torch.float32 if torch.device(device).type == "mps" else torch.float64


def rotary_angles(phase: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """``τ · θ`` reduced to ``(-2π, 2π)`` in ``phase``'s precision, then float32.

    ``phase`` broadcastable against ``temperature`` ``(R,)``. Computed in turns, ``θ · τ / 2π`` minus its integer part,
    so no 2π constant is rounded before the subtraction (the Triton kernels do exactly this). Differentiable: the
    integer part has no gradient, so ``d angle = τ dθ + θ dτ``.
    """
    turns = phase * (temperature.to(phase.dtype) / TWO_PI)
    return torch.frac(turns).float() * TWO_PI  # frac(x) = x - trunc(x), with the gradient of x


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``2R`` dims of ``x`` in GPT-NeoX halves; dims ``>= 2R`` pass through.

    ``x``: ``(B, T, ..., D)``; ``cos``/``sin``: ``(B, T, ..., R)`` float32, broadcastable to ``x``'s leading dims.
    Computed in float32, returned in x's dtype.
    """
    r = cos.shape[-1]  # rotary_pairs
    # Python-side dtype checks: a no-op `.float()` / `.to()` still costs a dispatch (~1 us) per call when decoding.
    x_float = x if x.dtype == torch.float32 else x.float()
    x1, x2 = x_float[..., :r], x_float[..., r : 2 * r]  # the GPT-NeoX halves
    parts = [x1 * cos - x2 * sin, x1 * sin + x2 * cos]
    if 2 * r < x.shape[-1]:
        parts.append(x_float[..., 2 * r :])  # partial rotary: the rest passes through
    rotated = torch.cat(parts, dim=-1)
    return rotated if x.dtype == torch.float32 else rotated.to(x.dtype)


def rotate_query_and_key(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``rotate`` q ``(B, T, Hq, D)`` and k ``(B, T, Hk, D)`` by their key head's ``cos``/``sin`` ``(B, T, Hk, R)`` in
    one pass over both: for a decoding step (T = 1) every op is tiny and costs its dispatch, so one rotation of the
    concatenated heads is cheaper than two. (For long sequences the concatenation would be an extra copy.)"""
    batch, seq_len, num_key_heads, head_dim = k.shape
    groups = q.shape[2] // num_key_heads  # query head h = hk * G + g rotates with key head hk
    both = torch.cat([q.reshape(batch, seq_len, num_key_heads, groups, head_dim), k.unsqueeze(3)], dim=3)
    rotated = rotate(both, cos.unsqueeze(3), sin.unsqueeze(3))  # (B, T, Hk, G + 1, D)
    return rotated[:, :, :, :groups].flatten(2, 3), rotated[:, :, :, groups]


def selective_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    increment: torch.Tensor,
    temperature: torch.Tensor,
    initial_phase: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Accumulate the phase and rotate q and k.

    ``θ_t = θ_0 + Σ_{s<=t} increment_s`` (float64, see ``phase_dtype``), ``angle_t = temperature · θ_t`` reduced mod
    2π, then each query head rotates with the phase of its key head (``h // (Hq / Hk)``).

    Args:
        q: ``(B, T, Hq, D)``; k: ``(B, T, Hk, D)``.
        increment: phase increments broadcastable to ``(B, T, Hk, R)`` (zero at padding positions), float32.
        temperature: ``(R,)``.
        initial_phase: ``(B, Hk, R)`` cached phase, or ``None`` for a sequence start.

    Returns:
        Rotated ``q`` and ``k`` (input dtypes) and the final phase ``(B, Hk, R)`` in ``phase_dtype``.
    """
    batch, seq_len, num_key_heads = k.shape[:3]
    rotary_pairs = temperature.shape[-1]
    dtype = phase_dtype(q.device)
    phase = torch.cumsum(increment.to(dtype), dim=1)  # (B, T, Hk, 1 or R)
    phase = phase.expand(batch, seq_len, num_key_heads, rotary_pairs)  # (B, T, Hk, R)
    if initial_phase is not None:
        phase = phase + initial_phase.to(dtype).unsqueeze(1)
    angle = rotary_angles(phase, temperature)
    cos, sin = angle.cos(), angle.sin()  # (B, T, Hk, R)
    groups = q.shape[2] // num_key_heads

    if seq_len > 0:
        final_phase = phase[:, -1]
    elif initial_phase is not None:
        final_phase = initial_phase.to(dtype)
    else:
        final_phase = phase.new_zeros(batch, num_key_heads, rotary_pairs)
    # A copy, never a view of `phase`: the cache must not keep the whole (B, T, Hk, R) tensor alive, and FSDP2
    # warns about (and cannot guard) view outputs of a sharded module.
    q_out = rotate(q, per_query_head(cos, groups), per_query_head(sin, groups))
    return q_out, rotate(k, cos, sin), final_phase.clone(memory_format=torch.contiguous_format)


def per_query_head(x: torch.Tensor, groups: int) -> torch.Tensor:
    """``(B, T, Hk, R)`` -> ``(B, T, Hk * G, R)``: query head ``h = hk * G + g`` takes key head ``hk``'s values.

    A copy: broadcasting ``(B, T, Hk, 1, R)`` against q viewed as ``(B, T, Hk, G, D)`` instead made each product of
    the rotation ~4x slower over long sequences (8k tokens, one thread: ~26 ms against ~6 ms per layer), PyTorch's
    element-wise loop then running innermost over the G broadcast heads."""
    if groups == 1:
        return x
    batch, seq_len, num_key_heads, rotary_pairs = x.shape
    return x.unsqueeze(3).expand(batch, seq_len, num_key_heads, groups, rotary_pairs).flatten(2, 3)


def writable(state: torch.Tensor | None, dtype: torch.dtype) -> bool:
    """Whether a single-token step can write its new state into the cached ``state`` (``in_place``): it has the
    step's dtype and is one dense tensor (a view of another, e.g. an expanded phase, is not the cache's own)."""
    return state is not None and state.dtype == dtype and state.is_contiguous()


def selective_rotary_step(
    q: torch.Tensor,
    k: torch.Tensor,
    increment: torch.Tensor,
    temperature: torch.Tensor,
    initial_phase: torch.Tensor | None = None,
    in_place: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``selective_rotary`` for one token per row (decoding), written for a single token: no time axis, no cumulative
    sum, q and k rotated together. A decoding step's cost is the number of tiny ops (each a few microseconds, whatever
    its size), not their arithmetic.

    Args:
        q: ``(B, 1, Hq, D)``; k: ``(B, 1, Hk, D)``.
        increment: broadcastable to ``(B, Hk, R)`` in ``phase_dtype`` (already rounded as a prefill rounds it).
        temperature: ``(R,)``.
        initial_phase: ``(B, Hk, R)`` cached phase, or ``None`` for a sequence start.
        in_place: write the new phase into ``initial_phase`` where it is ``writable`` (a static cache's tensor).

    Returns:
        Rotated ``q`` and ``k`` (input dtypes) and the new phase ``(B, Hk, R)`` in ``phase_dtype``.
    """
    batch, _, num_key_heads, _ = k.shape
    dtype = phase_dtype(q.device)
    previous = initial_phase
    if previous is not None and previous.dtype != dtype:
        previous = previous.to(dtype)
    if in_place and writable(previous, dtype):
        phase = previous.add_(increment)  # (B, Hk, R): the same sum as below, in the cache's tensor
    else:
        phase = increment if previous is None else increment + previous
        phase = phase.expand(batch, num_key_heads, temperature.shape[-1]).contiguous()  # (B, Hk, R)
    angle = rotary_angles(phase, temperature)[:, None]  # (B, 1, Hk, R)
    q_out, k_out = rotate_query_and_key(q, k, angle.cos(), angle.sin())
    return q_out, k_out, phase
