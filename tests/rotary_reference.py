"""Shared by the rotary module's and kernels' tests: an independent reference for the rotation, and the option sets
and module factory the tests run over."""

from __future__ import annotations

import torch

from selective_rope import SelectiveRopeGLAConfig
from selective_rope.modeling.rotary import SelectiveRotaryEmbedding

HIDDEN = 16


def rotate_exactly(x: torch.Tensor, phase: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """``x`` ``(B, T, H, D)`` rotated by float64 angles ``phase · τ`` (``phase`` ``(B, T, H, R)`` float64)."""
    angle = phase * temperature.double()
    cos, sin = angle.cos(), angle.sin()
    half = temperature.shape[0]
    x1, x2 = x[..., :half].double(), x[..., half:2 * half].double()
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos, x[..., 2 * half:].double()], -1)


def make_rotary(num_query_heads=4, num_key_heads=2, head_dim=8, dtype=torch.float64, device="cpu",
                **options) -> SelectiveRotaryEmbedding:
    """A rotary module over ``HIDDEN`` inputs with random non-zero parameters, in ``dtype`` on ``device``."""
    config = SelectiveRopeGLAConfig(hidden_size=HIDDEN, num_heads=num_query_heads, num_kv_heads=num_key_heads,
                                    expand_k=num_query_heads * head_dim / HIDDEN, **options)
    module = SelectiveRotaryEmbedding(config, num_query_heads, num_key_heads, head_dim).to(device=device, dtype=dtype)
    with torch.no_grad():  # make every parameter matter (the default gate bias and phase bias are zero)
        for name, param in module.named_parameters():
            if name != "temperature":
                param.add_(0.3 * torch.randn_like(param))
    return module


OPTION_GRID = [
    dict(),
    dict(phase_proj="full_rank"),
    dict(phase_proj="scalar", phase_gate_type="low_rank"),
    dict(phase_gate_type="channel", phase_bias=True),
    dict(phase_gate=False, phase_bias=True, phase_conv_size=0),
    dict(phase_conv_size=2, phase_conv_activation="silu", phase_proj="full_rank", phase_gate_type="channel"),
    dict(phase_proj_rank=3, phase_conv_activation="silu"),
    dict(temperature_type="rfa", temperature_theta=0.9),
    dict(temperature_type="gaussian", temperature_theta=0.5, temperature_max=2.0, temperature_seed=3),
    dict(temperature_type="laplace", temperature_theta=0.3, phase_proj="scalar"),
    dict(temperature_type="uniform", temperature_theta=1.5, phase_bias=True),
    dict(partial_rotary_factor=0.5),
    dict(partial_rotary_factor=0.5, phase_proj="full_rank", phase_gate_type="low_rank", phase_bias=True),
    dict(position_embedding="rope"),
    dict(position_embedding="rope", partial_rotary_factor=0.5, temperature_theta=100.0),
    # the official code's options (issue 24)
    dict(phase_proj="dense_low_rank", phase_proj_rank=5),
    dict(phase_proj="dense_low_rank", phase_conv_type="difference", phase_gate_type="low_rank", phase_gate_rank=3,
         phase_bias=True),
    dict(phase_conv_type="difference", phase_conv_activation="swish", phase_gate_type="channel", phase_gate_rank=7,
         partial_rotary_factor=0.5),
    dict(phase_conv_type="difference", phase_gate=False, phase_proj="full_rank"),
]
HEADS = [(4, 2), (2, 2), (4, 1)]

ROTATING_GRID = [o for o in OPTION_GRID if o.get("position_embedding", "selective_rope") != "nope"]
