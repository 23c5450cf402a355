"""Gated DeltaNet-specific properties: decay initialisation and flash-linear-attention parameter names."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from families import FAMILIES

GDN = FAMILIES["gated_deltanet"]


def test_decay_initialised_as_fla_and_kept_through_loading(tmp_path):
    model = GDN.lm_class(GDN.config_class(**{**GDN.tiny, "num_v_heads": 64}))
    for layer in model.model.layers:
        rate, dt = layer.attn.A_log.exp(), F.softplus(layer.attn.dt_bias)
        assert rate.min() > 0 and rate.max() <= 16 and rate.std() > 1  # A ~ U(0, 16)
        assert dt.min() >= 1e-3 - 1e-7 and dt.max() <= 0.1 + 1e-7 and dt.std() > 1e-3  # dt log-uniform in [1e-3, 0.1]
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    for ours, theirs in zip(model.model.layers, loaded.model.layers):
        assert torch.equal(ours.attn.A_log, theirs.attn.A_log) and torch.equal(ours.attn.dt_bias, theirs.attn.dt_bias)


def test_parameter_names_match_fla():
    """An fla GatedDeltaNet layer's weights load into our mixer by name (ours adds only the rotary module)."""
    from fla.layers import GatedDeltaNet as FlaGatedDeltaNet

    config = GDN.config_class(**GDN.tiny)
    fla_layer = FlaGatedDeltaNet(hidden_size=config.hidden_size, head_dim=config.head_dim, num_heads=config.num_heads,
                                 num_v_heads=config.num_v_heads, expand_v=config.expand_v, use_short_conv=True,
                                 conv_size=config.conv_size, allow_neg_eigval=config.allow_neg_eigval,
                                 norm_eps=config.norm_eps)
    ours = GDN.lm_class(config).model.layers[0].attn
    theirs = {name: tuple(t.shape) for name, t in fla_layer.state_dict().items()}
    mine = {name: tuple(t.shape) for name, t in ours.state_dict().items() if not name.startswith("rotary.")}
    assert mine == theirs
