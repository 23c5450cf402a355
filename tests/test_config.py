"""Config validation, Auto registration and import hygiene."""

from __future__ import annotations

import subprocess
import sys

import pytest

from families import FAMILIES
from isolation import import_blocker


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("position_embedding", "alibi", "position_embedding"),
        ("phase_gate_type", "token", "phase_gate_type"),
        ("phase_proj", "dense", "phase_proj"),
        ("phase_proj_rank", 0, "phase_proj_rank"),
        ("phase_conv_size", -1, "phase_conv_size"),
        ("phase_conv_activation", "relu", "phase_conv_activation"),
        ("temperature_type", "cosine", "temperature_type"),
        ("temperature_max", 0.0, "temperature_max"),
        ("temperature_theta", 0.5, "RoPE base"),  # rope needs a base >= 1
        ("partial_rotary_factor", 0.0, "partial_rotary_factor"),
        ("partial_rotary_factor", 0.3, "even integer"),  # 8 * 0.3 is not an even integer
    ],
)
def test_invalid_position_options_are_refused(family, field, value, message):
    with pytest.raises(ValueError, match=message) as error:
        family.config_class(**{**family.tiny, field: value})
    assert field in str(error.value) and repr(value) in str(error.value)


@pytest.mark.parametrize("kind, theta", [("rfa", 1.5), ("rfa", 500000.0), ("gaussian", -1.0), ("uniform", 0.0)])
def test_temperature_theta_depends_on_type(family, kind, theta):
    with pytest.raises(ValueError, match="temperature_theta"):
        family.config_class(**{**family.tiny, "temperature_type": kind, "temperature_theta": theta})
    family.config_class(**{**family.tiny, "temperature_type": kind, "temperature_theta": 0.5})  # valid


def test_default_config_is_valid(family):
    config = family.config_class()
    assert config.position_embedding == "selective_rope"


def test_valid_options_round_trip_through_dict(family):
    config = family.config_class(**{**family.tiny, "phase_proj": "full_rank", "phase_gate_type": "channel",
                                    "temperature_type": "laplace", "temperature_theta": 0.2, "phase_bias": True})
    again = family.config_class.from_dict(config.to_dict())
    assert again.to_dict() == config.to_dict()


@pytest.mark.parametrize("overrides, message", [
    (dict(num_heads=4, num_kv_heads=3), "num_kv_heads"),
    (dict(expand_k=0.3), "expand_k"),
    (dict(gate_logit_normalizer=0), "gate_logit_normalizer"),
    (dict(hidden_size=30, num_heads=4, num_kv_heads=4, expand_k=16 / 15, expand_v=16 / 15), "hidden_size"),
])
def test_invalid_gla_fields_are_refused(overrides, message):
    gla = FAMILIES["gla"]
    with pytest.raises(ValueError, match=message):
        gla.config_class(**{**gla.tiny, **overrides})


@pytest.mark.parametrize("overrides, message", [
    (dict(num_heads=2, num_v_heads=3), "num_v_heads"),
    (dict(expand_v=0.3), "expand_v"),
    (dict(output_gate_activation="relu"), "output_gate_activation"),
    (dict(hidden_size=33), "hidden_size"),  # Selective RoPE splits the input into one chunk per head
])
def test_invalid_gated_deltanet_fields_are_refused(overrides, message):
    gdn = FAMILIES["gated_deltanet"]
    with pytest.raises(ValueError, match=message):
        gdn.config_class(**{**gdn.tiny, **overrides})


@pytest.mark.parametrize("overrides, message", [
    (dict(num_attention_heads=4, num_key_value_heads=3), "num_key_value_heads"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(head_dim=7), "partial_rotary_factor"),  # the rotary part must be even
])
def test_invalid_fox_fields_are_refused(overrides, message):
    fox = FAMILIES["fox"]
    with pytest.raises(ValueError, match=message):
        fox.config_class(**{**fox.tiny, **overrides})


def test_fox_config_defaults_follow_llama():
    fox = FAMILIES["fox"]
    config = fox.config_class(hidden_size=64, num_attention_heads=4, rms_norm_eps=1e-5, attention_bias=True)
    assert (config.num_key_value_heads, config.head_dim, config.attention_output_bias) == (4, 16, True)
    assert config.norm_eps == 1e-5  # the shared block reads norm_eps
    assert fox.config_class(**{**fox.tiny, "attention_output_bias": False}).attention_output_bias is False


def test_import_needs_neither_triton_nor_fla():
    """`import selective_rope` works (and registers the Auto classes) where triton and fla cannot be imported."""
    code = import_blocker("triton", "fla") + """
import selective_rope
from transformers import AutoConfig
for model_type, name in [('selective_rope_gla', 'GLA'), ('selective_rope_gated_deltanet', 'GatedDeltaNet'),
                         ('selective_rope_fox', 'FoX')]:
    assert type(AutoConfig.for_model(model_type)).__name__ == f'SelectiveRope{name}Config'
assert not any(m.split('.')[0] == 'fla' for m in sys.modules)
print('ok')
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr
