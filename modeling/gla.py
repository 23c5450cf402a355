"""SelectiveRopeGLA: Gated Linear Attention (Yang et al., 2024) with Selective RoPE on q and k.

Mixer, as flash-linear-attention's ``GatedLinearAttention`` (parameter names match it):

    q, k, v  = proj(x)                        optional causal SiLU short convolutions
    gk       = logsigmoid(W₂ W₁ x + b) / gate_logit_normalizer        (B, T, Hk, Dk), ≤ 0
    q, k     = SelectiveRoPE(x, q, k)         last transform before the recurrence
    S_t      = diag(exp(gk_t)) S_{t-1} + k_t v_tᵀ,   o_t = S_tᵀ q_t · Dk^-0.5
    out      = o_proj(RMSNorm(o) ⊙ swish(g_proj(x)))
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..configuration.gla import SelectiveRopeGLAConfig
from ..kernels.gla import gated_linear_attention
from .base import SelectiveRopeForCausalLMBase, SelectiveRopeModelBase
from .layers import QKVShortConvolutions, RMSNorm
from .layout import valid_mask
from .mixer import LayerState
from .rotary import SelectiveRotaryEmbedding


class GatedLinearAttention(QKVShortConvolutions):
    """The GLA mixer (:class:`~.mixer.Mixer`). Its state: ``recurrent`` ``(B, H, Dk, Dv)`` float32, the short
    convolutions' histories and the rotary state, all running states."""

    def __init__(self, config: SelectiveRopeGLAConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_k_dim, self.head_v_dim = config.head_k_dim, config.head_v_dim
        self.gate_logit_normalizer = config.gate_logit_normalizer
        self.clamp_min = config.clamp_min
        hidden, key_width, value_width = config.hidden_size, self.num_kv_heads * self.head_k_dim, \
            self.num_kv_heads * self.head_v_dim

        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_k_dim, bias=False)
        self.k_proj = nn.Linear(hidden, key_width, bias=False)
        self.v_proj = nn.Linear(hidden, value_width, bias=False)
        self.init_short_convolutions(config.use_short_conv, (self.num_heads * self.head_k_dim, key_width, value_width),
                                     config.conv_size)
        self.gk_proj = nn.Sequential(nn.Linear(hidden, config.gate_low_rank_dim, bias=False),
                                     nn.Linear(config.gate_low_rank_dim, key_width, bias=True))
        self.rotary = SelectiveRotaryEmbedding(config, self.num_heads, self.num_kv_heads, self.head_k_dim)
        self.g_proj = (nn.Linear(hidden, self.num_heads * self.head_v_dim, bias=False)
                       if config.use_output_gate else None)
        self.g_norm = RMSNorm(self.head_v_dim, eps=config.norm_eps)
        self.o_proj = nn.Linear(self.num_heads * self.head_v_dim, hidden, bias=False)

    def forward(self, x: torch.Tensor, state: LayerState, *, lengths: torch.Tensor | None = None,
                cu_seqlens: torch.Tensor | None = None, backend: str = "torch",
                phase_input: torch.Tensor | None = None) -> torch.Tensor:
        """``x``: ``(B, T, D)`` right-padded rows -> ``(B, T, D)``; the new state goes into ``state``. ``phase_input``:
        what the Selective RoPE phase path reads instead of ``x`` (``x`` before its rounding to the model dtype).
        Packed sequences: ``x`` ``(1, total, D)`` with ``cu_seqlens`` (fla path only), one state row per sequence."""
        batch, seq_len, _ = x.shape
        # Head counts from the projections' outputs, not the config: under tensor parallelism each rank computes its
        # own heads (configuration/tensor_parallel.py).
        q, k, v = self.short_convolutions(self.q_proj(x), self.k_proj(x), self.v_proj(x), state, lengths, cu_seqlens)
        q = q.view(batch, seq_len, -1, self.head_k_dim)  # (B, T, Hq, Dk)
        k = k.view(batch, seq_len, -1, self.head_k_dim)  # (B, T, Hk, Dk)
        v = v.view(batch, seq_len, -1, self.head_v_dim)  # (B, T, Hk, Dv)
        gk = F.logsigmoid(self.gk_proj(x).float()) / self.gate_logit_normalizer
        if self.clamp_min is not None:
            gk = gk.clamp_min(self.clamp_min)
        gk = gk.view(batch, seq_len, -1, self.head_k_dim)

        rotary_state = state.scope("rotary")
        phase_input = x if phase_input is None else phase_input
        q, k, new_rotary_state = self.rotary(phase_input, q, k, rotary_state.previous(), lengths, cu_seqlens,
                                             backend=backend, overwrite_state=state.keep,  # the cache's tensors: ours
                                             in_place=state.in_place)
        rotary_state.update(new_rotary_state)

        if lengths is not None:  # pads neither write to nor decay the recurrent state
            valid = valid_mask(lengths, seq_len)[..., None, None]
            k, gk = k * valid, gk * valid
        # GQA: each key/value head serves `num_heads // num_kv_heads` consecutive query heads (inside the op).
        o, recurrent_state = gated_linear_attention(q, k, v, gk, initial_state=state.get("recurrent"),
                                                    output_final_state=state.keep, cu_seqlens=cu_seqlens,
                                                    in_place=state.in_place, backend=backend)
        if state.keep:
            state.set("recurrent", recurrent_state)

        o = self.g_norm(o)  # (B, T, H, Dv)
        o = o.reshape(batch, seq_len, -1)  # (B, T, H * Dv)
        if self.g_proj is not None:
            o = o * F.silu(self.g_proj(x))
        return self.o_proj(o)


class SelectiveRopeGLAModel(SelectiveRopeModelBase):
    config_class = SelectiveRopeGLAConfig
    mixer_class = GatedLinearAttention


class SelectiveRopeGLAForCausalLM(SelectiveRopeForCausalLMBase):
    config_class = SelectiveRopeGLAConfig
    model_class = SelectiveRopeGLAModel
