"""Building blocks shared by every family: RMSNorm, SwiGLU MLP, causal short convolution."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.conv_torch import causal_conv1d


class RMSNorm(nn.Module):
    """RMS norm computed in float32 and cast back (as Llama's); ``weight`` has shape ``(hidden_size,)``."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_float = x.float()
        x_float = x_float * torch.rsqrt(x_float.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x_float.to(x.dtype)


class GatedMLP(nn.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def mlp_width(hidden_size: int, hidden_ratio: int | None, intermediate_size: int | None) -> int:
    """flash-linear-attention's rule: 2/3 · ratio · hidden, rounded up to a multiple of 256, unless given."""
    if intermediate_size is not None:
        return intermediate_size
    width = int(hidden_size * (hidden_ratio or 4) * 2 / 3)
    return 256 * ((width + 255) // 256)


class ShortConvolution(nn.Conv1d):
    """Causal depthwise convolution over time with a carried state (flash-linear-attention's weight layout,
    ``(C, 1, K)``, so its checkpoints map onto ours)."""

    def __init__(self, channels: int, kernel_size: int, activation: str | None = None):
        super().__init__(channels, channels, kernel_size, groups=channels, bias=False, padding=kernel_size - 1)
        self.activation = activation

    def forward(self, x: torch.Tensor, state: torch.Tensor | None = None, lengths: torch.Tensor | None = None,
                dtype: torch.dtype | None = None,
                cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``x``: ``(B, T, C)`` -> ``(B, T, C)`` and the new state ``(B, K-1, C)``; computed in ``dtype`` if given.
        Packed sequences (``cu_seqlens``, ``x`` of shape ``(1, total, C)``): one state per sequence, ``(N, K-1, C)``."""
        if dtype is not None:
            x = x.to(dtype)
        return causal_conv1d(x, self.weight.squeeze(1), state, lengths, self.activation, cu_seqlens=cu_seqlens)
