"""SelectiveRopeGatedDeltaNet: Gated DeltaNet (Yang et al., 2025) with Selective RoPE on q and k.

Mixer, as flash-linear-attention's ``GatedDeltaNet`` (parameter names match it):

    q, k, v  = SiLU(conv(proj(x)))            causal short convolutions (or SiLU(proj(x)) without them)
    q, k     = L2-normalised per head
    β        = sigmoid(W_b x)                 ×2 with allow_neg_eigval: eigenvalues of (I - β k kᵀ) in (-1, 1]
    g        = -exp(A_log) · softplus(W_a x + dt_bias)                  log decay per value head, <= 0
    q, k     = SelectiveRoPE(x, q, k)         last transform; a rotation keeps ||k|| = 1
    S_t      = exp(g_t) S_{t-1} (I - β_t k_t k_tᵀ) + β_t v_t k_tᵀ,   o_t = S_t q_t · Dk^-0.5
    out      = o_proj(RMSNorm(o) ⊙ act(g_proj(x)))                     gated RMS norm per value head

Grouped value heads: with ``num_v_heads = G · num_heads``, value head ``j`` reads query/key head ``j // G``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init

from ..configuration.gated_deltanet import SelectiveRopeGatedDeltaNetConfig
from ..kernels.gated_delta import gated_delta_rule
from .base import SelectiveRopeForCausalLMBase, SelectiveRopeModelBase
from .layers import QKVShortConvolutions, RMSNorm
from .layout import valid_mask
from .mixer import LayerState
from .rotary import SelectiveRotaryEmbedding
from .tensor_parallel import local_tensor


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(||x||² + eps)`` over the last dim, in float32 (flash-linear-attention's ``l2norm``)."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


class GatedDeltaNet(QKVShortConvolutions):
    """The Gated DeltaNet mixer (:class:`~.mixer.Mixer`). Its state: ``recurrent`` ``(B, HV, Dk, Dv)`` float32, the
    short convolutions' histories and the rotary state, all running states."""

    def __init__(self, config: SelectiveRopeGatedDeltaNetConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_v_heads = config.num_heads, config.num_v_heads
        self.head_k_dim, self.head_v_dim = config.head_dim, config.head_v_dim
        self.allow_neg_eigval = config.allow_neg_eigval
        hidden, key_dim, value_dim = config.hidden_size, config.key_dim, config.value_dim

        self.q_proj = nn.Linear(hidden, key_dim, bias=False)
        self.k_proj = nn.Linear(hidden, key_dim, bias=False)
        self.v_proj = nn.Linear(hidden, value_dim, bias=False)
        self.a_proj = nn.Linear(hidden, self.num_v_heads, bias=False)
        self.b_proj = nn.Linear(hidden, self.num_v_heads, bias=False)
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads))
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads))
        self.A_log._no_weight_decay = True
        self.dt_bias._no_weight_decay = True
        self.init_short_convolutions(config.use_short_conv, (key_dim, key_dim, value_dim), config.conv_size)
        self.rotary = SelectiveRotaryEmbedding(config, self.num_heads, self.num_heads, self.head_k_dim)
        self.g_proj = nn.Linear(hidden, value_dim, bias=False) if config.use_gate else None
        self.gate_activation = config.output_gate_activation
        self.o_norm = RMSNorm(self.head_v_dim, eps=config.norm_eps)
        self.o_proj = nn.Linear(value_dim, hidden, bias=False)
        self.init_custom_parameters()

    @torch.no_grad()
    def init_custom_parameters(self) -> None:
        """flash-linear-attention's decay initialisation: ``A ~ U(0, 16)``; ``dt`` log-uniform in [1e-3, 0.1] and
        ``dt_bias = softplus⁻¹(dt)``. Also run by ``_init_weights``; tensors loaded from a checkpoint are kept."""
        heads = self.num_v_heads  # drawn in float32 whatever the default dtype (from_config(..., dtype=bf16) sets one)
        init.copy_(self.A_log, torch.empty(heads, dtype=torch.float32).uniform_(0, 16).log())
        dt_min, dt_max, dt_floor = 1e-3, 0.1, 1e-4
        uniform = torch.rand(heads, dtype=torch.float32)
        dt = torch.exp(uniform * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)).clamp(min=dt_floor)
        init.copy_(self.dt_bias, dt + torch.log(-torch.expm1(-dt)))

    def forward(self, x: torch.Tensor, state: LayerState, *, lengths: torch.Tensor | None = None,
                cu_seqlens: torch.Tensor | None = None, backend: str = "torch",
                phase_input: torch.Tensor | None = None) -> torch.Tensor:
        """``x``: ``(B, T, D)`` right-padded rows -> ``(B, T, D)``; the new state goes into ``state``. ``phase_input``:
        what the Selective RoPE phase path reads instead of ``x`` (``x`` before its rounding to the model dtype).
        Packed sequences: ``x`` ``(1, total, D)`` with ``cu_seqlens`` (fla path only), one state row per sequence."""
        batch, seq_len, _ = x.shape
        # Head counts from the projections' outputs, not the config: under tensor parallelism each rank computes its
        # own heads (configuration/tensor_parallel.py), whole groups of value heads behind their query/key head.
        q, k, v = self.short_convolutions(self.q_proj(x), self.k_proj(x), self.v_proj(x), state, lengths, cu_seqlens)
        if not self.use_short_conv:  # the SiLU the convolutions would apply
            q, k, v = F.silu(q), F.silu(k), F.silu(v)
        q = l2_normalize(q.view(batch, seq_len, -1, self.head_k_dim)).to(x.dtype)  # (B, T, H, Dk)
        k = l2_normalize(k.view(batch, seq_len, -1, self.head_k_dim)).to(x.dtype)
        v = v.view(batch, seq_len, -1, self.head_v_dim)  # (B, T, HV, Dv)

        beta = torch.sigmoid(self.b_proj(x).float())  # (B, T, HV)
        if self.allow_neg_eigval:
            beta = beta * 2
        A_log, dt_bias = local_tensor(self.A_log), local_tensor(self.dt_bias)  # this rank's value heads under TP
        g = -A_log.float().exp() * F.softplus(self.a_proj(x).float() + dt_bias.float())  # (B, T, HV)

        rotary_state = state.scope("rotary")
        phase_input = x if phase_input is None else phase_input
        q, k, new_rotary_state = self.rotary(phase_input, q, k, rotary_state.previous(), lengths, cu_seqlens,
                                             backend=backend, overwrite_state=state.keep,  # the cache's tensors: ours
                                             in_place=state.in_place)
        rotary_state.update(new_rotary_state)

        if lengths is not None:  # β = 0 and g = 0: pads leave the state exactly as it was
            valid = valid_mask(lengths, seq_len)[..., None]
            beta, g = beta * valid, g * valid
        # Grouped value heads: value head j reads key head j // (num_v_heads / num_heads), inside the op.
        o, recurrent_state = gated_delta_rule(q, k, v, g, beta, initial_state=state.get("recurrent"),
                                              output_final_state=state.keep, cu_seqlens=cu_seqlens,
                                              in_place=state.in_place, backend=backend)
        if state.keep:
            state.set("recurrent", recurrent_state)

        o = self.o_norm(o)  # (B, T, HV, Dv)
        if self.g_proj is not None:
            gate = self.g_proj(x).view(batch, seq_len, -1, self.head_v_dim)
            o = o * (torch.sigmoid(gate) if self.gate_activation == "sigmoid" else F.silu(gate))
        o = o.reshape(batch, seq_len, -1)  # (B, T, HV * Dv)
        return self.o_proj(o)


class SelectiveRopeGatedDeltaNetModel(SelectiveRopeModelBase):
    config_class = SelectiveRopeGatedDeltaNetConfig
    mixer_class = GatedDeltaNet
    # The decay parameters stay float32 in bf16/fp16 too: exp(A_log) sets every head's forgetting rate.
    _keep_in_fp32_modules_strict = ["rotary", "A_log", "dt_bias"]


class SelectiveRopeGatedDeltaNetForCausalLM(SelectiveRopeForCausalLMBase):
    config_class = SelectiveRopeGatedDeltaNetConfig
    model_class = SelectiveRopeGatedDeltaNetModel
    _keep_in_fp32_modules_strict = SelectiveRopeGatedDeltaNetModel._keep_in_fp32_modules_strict
