"""Building blocks shared by every family: RMSNorm, SwiGLU MLP, causal short convolution (and the q/k/v triple of
them that GLA and Gated DeltaNet share)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init

from ..kernels.conv_torch import causal_conv1d
from .mixer import LayerState


class RMSNorm(nn.Module):
    """RMS norm computed in float32 and cast back (as Llama's); ``weight`` has shape ``(hidden_size,)``."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # dtype checked in Python: a no-op cast still costs a dispatch, twice per norm and token when decoding
        x_float = x if x.dtype == torch.float32 else x.float()
        x_float = x_float * torch.rsqrt(x_float.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * (x_float if x.dtype == torch.float32 else x_float.to(x.dtype))


class ZeroCentredRMSNorm(nn.Module):
    """RMS norm scaled by ``1 + weight`` (Qwen3-Next's and Qwen3.5's layout; ``weight`` starts at 0), computed in
    float32 and cast back after the scaling, as theirs. Kept in this form rather than folded into a plain weight:
    ``1 + w`` rounded to bf16 is not ``w`` rounded to bf16 plus one, so a folded bf16 checkpoint would not be exact."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    @torch.no_grad()
    def init_custom_parameters(self) -> None:
        """Zero: the identity scale (transformers' initialisation would set ones, a scale of 2); a loaded weight is
        kept."""
        init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_float = x.float()
        x_float = x_float * torch.rsqrt(x_float.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x_float * (1.0 + self.weight.float())).to(x.dtype)


# The configs' `hidden_act` values: "swish" (flash-linear-attention's name) and "silu" (Llama's) are one function.
MLP_ACTIVATIONS = {"silu": F.silu, "swish": F.silu}


class GatedMLP(nn.Module):
    """SwiGLU feed-forward: ``down(act(gate(x)) * up(x))``, ``act`` the config's ``hidden_act``."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False, activation: str = "silu"):
        super().__init__()
        if activation not in MLP_ACTIVATIONS:
            raise ValueError(f"hidden_act={activation!r} is not supported: expected one of {list(MLP_ACTIVATIONS)}")
        self.act_fn = MLP_ACTIVATIONS[activation]
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class ShortConvolution(nn.Conv1d):
    """Causal depthwise convolution over time with a carried state (flash-linear-attention's weight layout,
    ``(C, 1, K)``, so its checkpoints map onto ours)."""

    def __init__(self, channels: int, kernel_size: int, activation: str | None = None):
        super().__init__(channels, channels, kernel_size, groups=channels, bias=False, padding=kernel_size - 1)
        self.activation = activation

    def forward(self, x: torch.Tensor, state: torch.Tensor | None = None, lengths: torch.Tensor | None = None,
                dtype: torch.dtype | None = None, cu_seqlens: torch.Tensor | None = None,
                in_place: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """``x``: ``(B, T, C)`` -> ``(B, T, C)`` and the new state ``(B, K-1, C)``; computed in ``dtype`` if given.
        Packed sequences (``cu_seqlens``, ``x`` of shape ``(1, total, C)``): one state per sequence, ``(N, K-1, C)``.
        ``in_place``: the new state is written into ``state`` (``causal_conv1d``)."""
        if dtype is not None:
            x = x.to(dtype)
        return causal_conv1d(x, self.weight.squeeze(1), state, lengths, self.activation, cu_seqlens=cu_seqlens,
                             in_place=in_place)


class QKVShortConvolutions(nn.Module):
    """Base of the mixers with optional causal SiLU short convolutions on q, k and v (GLA, Gated DeltaNet).

    The modules are the mixer's own ``q_conv1d``, ``k_conv1d``, ``v_conv1d`` (flash-linear-attention's parameter
    names, so its checkpoints map onto ours) and their histories the layer state's ``q_conv``, ``k_conv``, ``v_conv``.
    """

    def init_short_convolutions(self, use_short_conv: bool, widths: tuple[int, int, int], conv_size: int) -> None:
        """``widths``: the channels of q, k and v."""
        self.use_short_conv = use_short_conv
        if use_short_conv:
            self.q_conv1d, self.k_conv1d, self.v_conv1d = (
                ShortConvolution(width, conv_size, activation="silu") for width in widths)

    def short_convolutions(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: LayerState,
                           lengths: torch.Tensor | None, cu_seqlens: torch.Tensor | None):
        """``(q, k, v)`` ``(B, T, C)`` each through its convolution, continuing and updating the cached histories;
        unchanged without short convolutions."""
        if not self.use_short_conv:
            return q, k, v
        convolved = []
        for name, x, conv in (("q_conv", q, self.q_conv1d), ("k_conv", k, self.k_conv1d), ("v_conv", v, self.v_conv1d)):
            x, history = conv(x, state.get(name), lengths, cu_seqlens=cu_seqlens,
                              in_place=state.in_place)  # history (B, K-1, C)
            state.set(name, history)
            convolved.append(x)
        return tuple(convolved)
