"""An independent reference for the rotation, shared by the rotary module's and the Triton kernels' tests."""

from __future__ import annotations

import torch


def rotate_exactly(x: torch.Tensor, phase: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """``x`` ``(B, T, H, D)`` rotated by float64 angles ``phase · τ`` (``phase`` ``(B, T, H, R)`` float64)."""
    angle = phase * temperature.double()
    cos, sin = angle.cos(), angle.sin()
    half = temperature.shape[0]
    x1, x2 = x[..., :half].double(), x[..., half:2 * half].double()
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos, x[..., 2 * half:].double()], -1)
