"""The GLA mixer (modeling/gla.py): what it computes, written out independently on its own weights, and
flash-linear-attention's parameter names."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from selective_rope.modeling.mixer import LayerState

from families import FAMILIES

GLA = FAMILIES["gla"]


def short_conv(x: torch.Tensor, conv: torch.nn.Conv1d) -> torch.Tensor:
    """Causal depthwise convolution + SiLU with ``conv``'s ``(C, 1, K)`` weight: ``(B, T, C) -> (B, T, C)``."""
    width = conv.weight.shape[-1]
    out = F.conv1d(F.pad(x.transpose(1, 2), (width - 1, 0)), conv.weight, groups=x.shape[-1])
    return F.silu(out).transpose(1, 2)


def gla_reference(attn, x: torch.Tensor) -> torch.Tensor:
    """The mixer's equations (module docstring) with NoPE, in float64, as a per-token recurrence."""
    from fla.ops.gla.naive import naive_recurrent_gla

    attn = attn.double()
    x = x.double()
    batch, seq_len, _ = x.shape
    heads, kv_heads, dk, dv = attn.num_heads, attn.num_kv_heads, attn.head_k_dim, attn.head_v_dim
    q = short_conv(attn.q_proj(x), attn.q_conv1d).view(batch, seq_len, heads, dk)
    k = short_conv(attn.k_proj(x), attn.k_conv1d).view(batch, seq_len, kv_heads, dk)
    v = short_conv(attn.v_proj(x), attn.v_conv1d).view(batch, seq_len, kv_heads, dv)
    gk = (F.logsigmoid(attn.gk_proj(x)) / attn.gate_logit_normalizer).view(batch, seq_len, kv_heads, dk)
    groups = heads // kv_heads  # GQA: key/value head j serves query heads j * groups ... (j + 1) * groups - 1
    k, v, gk = (t.repeat_interleave(groups, dim=2) for t in (k, v, gk))
    o, _ = naive_recurrent_gla(q, k, v, gk)  # (B, T, H, Dv); S_t = diag(exp(gk_t)) S_{t-1} + k_t v_tᵀ
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + attn.g_norm.eps) * attn.g_norm.weight
    o = o.reshape(batch, seq_len, heads * dv) * F.silu(attn.g_proj(x))
    return attn.o_proj(o)


def test_mixer_is_gated_linear_attention_on_its_own_weights():
    config = GLA.config_class(**{**GLA.tiny, "position_embedding": "nope"})
    attn = GLA.lm_class(config).model.layers[0].attn.eval()
    assert attn.num_heads > attn.num_kv_heads  # the tiny config has grouped heads
    with torch.no_grad():
        for name, param in attn.named_parameters():  # non-trivial norm weights and biases
            if name.endswith("norm.weight") or name.endswith("bias"):
                param.add_(0.2 * torch.randn_like(param))
        x = torch.randn(2, 9, config.hidden_size)
        expected = gla_reference(copy.deepcopy(attn), x)  # (the reference casts its copy to float64)
        out = attn(x, LayerState())  # (B, T, D); a fresh state: a sequence start
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-4)


def test_parameter_names_match_fla():
    """An fla GatedLinearAttention layer's weights load into our mixer by name (ours adds only the rotary module;
    fla's output norm ``g_norm_swish_gate`` is ``g_norm`` here, the one rename the converter makes)."""
    from fla.layers import GatedLinearAttention as FlaGatedLinearAttention

    from selective_rope.conversion.fla import fla_key

    config = GLA.config_class(**GLA.tiny)
    fla_layer = FlaGatedLinearAttention(hidden_size=config.hidden_size, expand_k=config.expand_k,
                                        expand_v=config.expand_v, num_heads=config.num_heads,
                                        num_kv_heads=config.num_kv_heads, use_short_conv=True,
                                        conv_size=config.conv_size, gate_low_rank_dim=config.gate_low_rank_dim,
                                        norm_eps=config.norm_eps)
    ours = GLA.lm_class(config).model.layers[0].attn
    theirs = {fla_key("gla", f"model.layers.0.attn.{name}").removeprefix("model.layers.0.attn."): tuple(t.shape)
              for name, t in fla_layer.state_dict().items()}
    mine = {name: tuple(t.shape) for name, t in ours.state_dict().items() if not name.startswith("rotary.")}
    assert mine == theirs
