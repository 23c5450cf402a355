"""Selective RoPE's cumulative phase and rotation, pure PyTorch (the reference the Triton kernel must match)."""

from __future__ import annotations

import torch


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``2R`` dims of ``x`` in GPT-NeoX halves; dims ``>= 2R`` pass through.

    ``x``: ``(B, T, H, D)``; ``cos``/``sin``: ``(B, T, H, R)`` float32. Computed in float32, returned in x's dtype.
    """
    half = cos.shape[-1]
    x_float = x.float()
    x1, x2, rest = x_float[..., :half], x_float[..., half : 2 * half], x_float[..., 2 * half :]
    rotated = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos, rest], dim=-1)
    return rotated.to(x.dtype)


def selective_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    increment: torch.Tensor,
    temperature: torch.Tensor,
    initial_phase: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Accumulate the phase and rotate q and k.

    ``θ_t = θ_0 + Σ_{s<=t} increment_s`` (float32), ``angle_t = temperature · θ_t``, then each query head rotates with
    the phase of its key head (``h // (Hq / Hk)``).

    Args:
        q: ``(B, T, Hq, D)``; k: ``(B, T, Hk, D)``.
        increment: phase increments broadcastable to ``(B, T, Hk, R)`` (zero at padding positions).
        temperature: ``(R,)``.
        initial_phase: ``(B, Hk, R)`` cached phase, or ``None`` for a sequence start.

    Returns:
        Rotated ``q`` and ``k`` (input dtypes) and the final phase ``(B, Hk, R)`` float32.
    """
    batch, seq_len, num_key_heads = k.shape[:3]
    half = temperature.shape[-1]
    phase = torch.cumsum(increment.float(), dim=1).expand(batch, seq_len, num_key_heads, half)  # (B, T, Hk, R)
    if initial_phase is not None:
        phase = phase + initial_phase.float().unsqueeze(1)
    angle = phase * temperature.float()
    cos, sin = angle.cos(), angle.sin()
    groups = q.shape[2] // num_key_heads
    q_cos, q_sin = (t.repeat_interleave(groups, dim=2) for t in (cos, sin)) if groups > 1 else (cos, sin)

    if seq_len > 0:
        final_phase = phase[:, -1]
    elif initial_phase is not None:
        final_phase = initial_phase.float()
    else:
        final_phase = phase.new_zeros(batch, num_key_heads, half)
    # A copy, never a view of `phase`: the cache must not keep the whole (B, T, Hk, R) tensor alive, and FSDP2
    # warns about (and cannot guard) view outputs of a sharded module.
    return rotate(q, q_cos, q_sin), rotate(k, cos, sin), final_phase.clone(memory_format=torch.contiguous_format)
