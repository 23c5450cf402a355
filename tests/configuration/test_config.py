"""Config validation, Auto registration and import hygiene."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from dataclasses import fields

import pytest
import torch
from huggingface_hub.dataclasses import type_validator
from huggingface_hub.errors import StrictDataclassError
from transformers import AutoConfig, PreTrainedConfig

from selective_rope.configuration.position_embedding import InvalidConfigError

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
        ("phase_conv_activation", "Swish", "phase_conv_activation"),
        ("phase_conv_type", "skip", "phase_conv_type"),
        ("phase_gate_rank", 0, "phase_gate_rank"),
        ("phase_gate_rank", True, "phase_gate_rank"),
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


def test_official_options_round_trip_as_given(family, tmp_path):
    """The options from the paper's code (issue 24) survive dict, JSON and save_pretrained; ``"swish"`` is kept as
    written (the module reads it as ``"silu"``), so a config saved with it reads back the same."""
    options = dict(phase_proj="dense_low_rank", phase_proj_rank=3, phase_conv_type="difference",
                   phase_conv_activation="swish", phase_gate_type="channel", phase_gate_rank=7)
    config = family.config_class(**{**family.tiny, **options})
    config.save_pretrained(tmp_path)
    for again in (family.config_class.from_dict(config.to_dict()), AutoConfig.from_pretrained(tmp_path),
                  family.config_class(**json.loads(config.to_json_string(use_diff=False)))):
        assert {name: getattr(again, name) for name in options} == options
    assert json.loads((tmp_path / "config.json").read_text())["phase_conv_activation"] == "swish"
    defaults = family.config_class(**family.tiny)
    assert (defaults.phase_conv_type, defaults.phase_gate_rank) == ("learned", 16)


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


@pytest.mark.parametrize("value", [-1.0, 0, math.nan, "1e-6"])
def test_fox_norm_eps_alias_is_checked_as_rms_norm_eps(value, tmp_path):
    """``norm_eps`` is FoX's alias of ``rms_norm_eps`` (transformers' ``attribute_map``): given to the constructor,
    assigned or updated, it is checked as the field itself, and names both."""
    fox = FAMILIES["fox"]
    message = "`norm_eps` \\(`rms_norm_eps`\\)="
    with pytest.raises(InvalidConfigError, match=message):
        fox.config_class(**{**fox.tiny, "norm_eps": value})
    config = fox.config_class(**fox.tiny)
    with pytest.raises(InvalidConfigError, match=message):
        config.norm_eps = value
    with pytest.raises(InvalidConfigError, match=message):
        config.update({"norm_eps": value})
    assert config.rms_norm_eps == fox.config_class(**fox.tiny).rms_norm_eps  # left as it was
    config.norm_eps = 1e-5
    assert config.rms_norm_eps == 1e-5
    config.save_pretrained(tmp_path)
    assert AutoConfig.from_pretrained(tmp_path).rms_norm_eps == 1e-5


def test_sampled_temperature_takes_every_seed_the_config_accepts(family):
    for seed in (-(2**63), 2**64 - 1):
        config = family.config_class(**{**family.tiny, "temperature_type": "gaussian", "temperature_theta": 1.0,
                                        "temperature_seed": seed})
        family.lm_class(config)  # builds: the seed reaches torch.Generator.manual_seed


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


# -- every field is type- and range-checked (issue 19) -----------------------------------------------------------------

BASE_FIELDS = {f.name for f in fields(PreTrainedConfig)}


def own_fields(config_class):
    return [f for f in fields(config_class) if f.name not in BASE_FIELDS]


def wrong_types(annotation) -> list:
    """Values of the wrong type for ``annotation`` among a few that configs receive by mistake."""
    def fits(value):
        try:
            type_validator("field", value, annotation)
        except TypeError:
            return False
        return True

    return [value for value in ("false", "1", 2.5, True, None, [1]) if not fits(value)]


def test_every_field_refuses_wrong_types(family):
    """Strings in bool fields (not truthy!), bools or floats in int fields, None where not optional, ..."""
    checked = 0
    for field in own_fields(family.config_class):
        for value in wrong_types(field.type):
            with pytest.raises(ValueError) as error:
                family.config_class(**{**family.tiny, field.name: value})
            assert f"`{field.name}`={value!r}" in str(error.value) and "\n" not in str(error.value)
            checked += 1
    assert checked > 3 * len(own_fields(family.config_class))


@pytest.mark.parametrize("field, value", [("use_k_shift", "false"), ("tie_word_embeddings", "false"),
                                          ("temperature_trainable", "false"), ("phase_bias", "no"),
                                          ("temperature_theta", None), ("num_hidden_layers", True)])
def test_the_audits_wrong_types_are_refused(field, value):
    fox = FAMILIES["fox"]
    with pytest.raises(ValueError, match=f"`{field}`={value!r} is invalid: expected"):
        fox.config_class(**{**fox.tiny, field: value})


SHARED_RANGES = {"phase_proj_rank": [0, 2**31], "phase_gate_rank": [0, -2, 10**12], "phase_conv_size": [-1, 2**64],
                 "temperature_theta": [math.nan, math.inf], "temperature_max": [0, -1.0, math.nan],
                 "partial_rotary_factor": [0, 1.5, math.nan], "temperature_seed": [2**64, -(2**63) - 1]}
FAMILY_RANGES = {
    "gla": {"vocab_size": [0, 2**64], "hidden_size": [0, 10**12], "num_hidden_layers": [0, -1, 10**12],
            "num_heads": [0, 2**31], "num_kv_heads": [0], "expand_k": [0, -0.5, 1e30], "expand_v": [0, 2.0**31],
            "conv_size": [0, 10**12], "gate_logit_normalizer": [0], "gate_low_rank_dim": [0, 2**64],
            "clamp_min": [1.0, math.nan], "hidden_ratio": [0, 10**12], "intermediate_size": [0, 2**64],
            "norm_eps": [0, -1, math.nan], "initializer_range": [-0.1, math.inf, 1e12]},
    "gated_deltanet": {"vocab_size": [0, 10**12], "hidden_size": [-3, 2**64], "num_hidden_layers": [0, 2**16 + 1],
                       "num_heads": [0, 2**40], "num_v_heads": [0, 2**40], "head_dim": [0, 10**12],
                       "expand_v": [0, 1e30], "conv_size": [0], "hidden_ratio": [0], "intermediate_size": [0, 10**12],
                       "norm_eps": [-1e-6], "initializer_range": [-1.0, 1.5]},
    "fox": {"vocab_size": [0, 10**30], "hidden_size": [0, 2**64], "intermediate_size": [0, 10**12],
            "num_hidden_layers": [-1, 10**12], "num_attention_heads": [0, 2**64], "num_key_value_heads": [0, 2**31],
            "head_dim": [0, 10**12], "rms_norm_eps": [0, math.inf], "initializer_range": [math.nan, 1e12]},
    "hybrid": {"vocab_size": [0], "hidden_size": [0], "num_hidden_layers": [0], "intermediate_size": [0],
               "rms_norm_eps": [0], "num_attention_heads": [0], "num_key_value_heads": [0], "head_dim": [0],
               "linear_num_key_heads": [0], "linear_num_value_heads": [0], "linear_key_head_dim": [0],
               "linear_value_head_dim": [0], "linear_conv_kernel_dim": [0], "num_experts": [-1],
               "num_experts_per_tok": [0], "moe_intermediate_size": [0], "shared_expert_intermediate_size": [0],
               "decoder_sparse_step": [0], "router_aux_loss_coef": [math.nan], "initializer_range": [-0.1]},
}


def test_every_range_checked_field_refuses_out_of_range_values(family):
    table = {**SHARED_RANGES, **FAMILY_RANGES[family.name]}
    validated = {f.name for f in own_fields(family.config_class) if f.metadata.get("validator")}
    assert set(table) == validated, "every field with a range validator has out-of-range values here"
    for name, values in table.items():
        for value in values:
            with pytest.raises(ValueError, match=re.escape(f"`{name}`={value!r} is invalid: must be")):
                family.config_class(**{**family.tiny, name: value})


def test_a_model_too_large_to_allocate_is_refused_before_anything_is_allocated(family):
    """Every size within its own bound, the whole beyond any model: refused by the config's size estimate with one
    line naming the sizes, at construction (not after minutes of building or deep in the allocator)."""
    for sizes in (dict(vocab_size=2**31 - 1, hidden_size=2**20), dict(num_hidden_layers=2**16, hidden_size=2**20)):
        expected = r"`hidden_size`=1048576 is invalid: .* at most 4.4e\+12 \(2\*\*42\)"
        if "layer_types" in family.tiny:  # the hybrid's list of one type per layer follows the layer count
            sizes["layer_types"] = None
        with pytest.raises(ValueError, match=expected) as error:
            family.config_class(**{**family.tiny, **sizes})
        assert "\n" not in str(error.value)


def test_the_size_estimate_is_a_lower_bound_of_the_parameters(family):
    """The estimate counts only what every model of the family has: never more than the model built."""
    for options in ({}, {"tie_word_embeddings": True}, *family.variants.values()):
        config = family.config_class(**{**family.tiny, **options})
        model = family.lm_class(config)
        actual = sum(p.numel() for p in model.parameters())
        assert 0.5 * actual <= config.estimated_parameters() <= actual, options


@pytest.mark.parametrize("field, value", [("pad_token_id", -1), ("bos_token_id", 61), ("eos_token_id", 10**12),
                                          ("eos_token_id", [2, 61]), ("pad_token_id", -(2**64))])
def test_token_ids_outside_the_vocabulary_are_refused(family, field, value, tmp_path):
    """``pad_token_id=-1`` would make the last embedding row the (never trained) padding row; an id >= vocab_size used
    to fail only when the model was built. Both refused at construction, and from a saved config.json too."""
    assert family.tiny["vocab_size"] == 61
    with pytest.raises(ValueError, match=re.escape(f"`{field}`={value!r} is invalid: must be None or a token id in "
                                                   "[0, 61) (vocab_size).")):
        family.config_class(**{**family.tiny, field: value})
    family.config_class(**{**family.tiny, field: None}).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**saved, field: value}))
    with pytest.raises(ValueError, match=f"`{field}`="):
        AutoConfig.from_pretrained(tmp_path)
    edge = family.config_class(**{**family.tiny, "pad_token_id": 60, "eos_token_id": [0, 60]})
    assert family.lm_class(edge).model.embeddings.padding_idx == 60


def test_config_errors_are_value_errors_and_strict_dataclass_errors(family):
    with pytest.raises(InvalidConfigError) as error:
        family.config_class(**{**family.tiny, "phase_gate": "true"})
    assert isinstance(error.value, ValueError) and isinstance(error.value, StrictDataclassError)


def test_assignments_are_checked_and_save_refuses_inconsistent_configs(family, tmp_path):
    config = family.config_class(**family.tiny)
    with pytest.raises(ValueError, match="`use_cache`='no'"):
        config.use_cache = "no"
    with pytest.raises(ValueError, match="`hidden_size`=0"):
        config.hidden_size = 0
    config.partial_rotary_factor = 0.3  # a valid value on its own, inconsistent with the head size
    model = family.lm_class(family.config_class(**family.tiny))
    model.config.partial_rotary_factor = 0.3
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        model.save_pretrained(tmp_path / "model")
    assert not (tmp_path / "model").exists()  # nothing half-written


@pytest.mark.parametrize("overrides", [
    dict(head_dim=7),  # an odd head size cannot rotate
    dict(num_attention_heads=3, num_key_value_heads=3, head_dim=6, hidden_size=32),  # 32 does not split into 3 heads
    dict(partial_rotary_factor=0.3, temperature_theta=0.5),
])
def test_rotation_rules_do_not_refuse_nope(overrides):
    fox = FAMILIES["fox"]
    with pytest.raises(ValueError):
        fox.config_class(**{**fox.tiny, **overrides})
    config = fox.config_class(**{**fox.tiny, **overrides, "position_embedding": "nope"})
    model = fox.lm_class(config).eval()
    ids = torch.randint(3, 61, (2, 5))
    assert model(ids).logits.shape == (2, 5, 61)


def test_nope_gated_deltanet_and_gla_need_no_divisible_hidden_size():
    gdn, gla = FAMILIES["gated_deltanet"], FAMILIES["gla"]
    for family, overrides in [(gdn, dict(hidden_size=33)),
                              (gla, dict(hidden_size=30, num_heads=4, num_kv_heads=4, expand_k=16 / 15,
                                         expand_v=16 / 15))]:
        with pytest.raises(ValueError):
            family.config_class(**{**family.tiny, **overrides})
        config = family.config_class(**{**family.tiny, **overrides, "position_embedding": "nope"})
        assert family.lm_class(config)(torch.randint(3, 61, (1, 4))).logits.shape == (1, 4, 61)


def test_round_trips_through_dict_json_and_save_pretrained(family, tmp_path):
    def fields_of(config):
        return {name: value for name, value in config.to_dict().items() if name != "_name_or_path"}

    config = family.config_class(**{**family.tiny, "temperature_theta": 10000, "phase_conv_activation": "silu",
                                    "phase_gate_type": "low_rank", "backend": "torch"})
    assert fields_of(family.config_class.from_dict(config.to_dict())) == fields_of(config)
    assert fields_of(family.config_class(**json.loads(config.to_json_string(use_diff=False)))) == fields_of(config)
    config.save_pretrained(tmp_path)
    for loaded in (family.config_class.from_pretrained(tmp_path), AutoConfig.from_pretrained(tmp_path)):
        assert type(loaded) is family.config_class and fields_of(loaded) == fields_of(config)
    assert loaded.temperature_theta == 10000  # an int is a valid number


# config.json files written by earlier versions of this package (values as JSON gives them: ints for round floats).
OLD_CONFIGS = {
    "gla": {"architectures": ["SelectiveRopeGLAForCausalLM"], "auto_map": {
                "AutoConfig": "configuration_gla.SelectiveRopeGLAConfig",
                "AutoModelForCausalLM": "modeling_gla.SelectiveRopeGLAForCausalLM"},
            "backend": "auto", "bos_token_id": 1, "clamp_min": None, "conv_size": 3, "dtype": "float32",
            "eos_token_id": 2, "expand_k": 1, "expand_v": 1.0, "gate_logit_normalizer": 16, "gate_low_rank_dim": 16,
            "hidden_act": "swish", "hidden_ratio": 4, "hidden_size": 32, "initializer_range": 0.2,
            "intermediate_size": 48, "model_type": "selective_rope_gla", "norm_eps": 1e-06, "num_heads": 4,
            "num_hidden_layers": 2, "num_kv_heads": 2, "pad_token_id": 0, "partial_rotary_factor": 1,
            "phase_bias": True, "phase_conv_activation": "silu", "phase_conv_size": 4, "phase_gate": True,
            "phase_gate_type": "channel", "phase_proj": "full_rank", "phase_proj_rank": 32,
            "position_embedding": "selective_rope", "temperature_max": 1, "temperature_seed": 0,
            "temperature_theta": 0.2, "temperature_trainable": False, "temperature_type": "laplace",
            "tie_word_embeddings": False, "transformers_version": "5.23.0", "use_cache": True,
            "use_output_gate": True, "use_short_conv": True, "vocab_size": 61},
    "fox": {"architectures": ["SelectiveRopeFoXForCausalLM"], "attention_bias": True, "attention_output_bias": False,
            "bos_token_id": 1, "dtype": "bfloat16", "eos_token_id": [2, 3], "head_dim": 8, "hidden_act": "silu",
            "hidden_size": 32, "initializer_range": 0.02, "intermediate_size": 48, "model_type": "selective_rope_fox",
            "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2, "pad_token_id": None,
            "partial_rotary_factor": 1.0, "position_embedding": "rope", "rms_norm_eps": 1e-05,
            "temperature_theta": 1000000, "temperature_type": "rope", "tie_word_embeddings": True,
            "transformers_version": "5.23.0", "use_forget_gate": False, "vocab_size": 61},
}


@pytest.mark.parametrize("name", sorted(OLD_CONFIGS))
def test_configs_saved_by_earlier_versions_still_load(name, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(OLD_CONFIGS[name]))
    config = AutoConfig.from_pretrained(tmp_path)
    assert type(config) is FAMILIES[name].config_class
    for field, value in OLD_CONFIGS[name].items():
        if field in {f.name for f in own_fields(type(config))}:
            assert getattr(config, field) == value, field
    FAMILIES[name].lm_class(config)  # and builds


def test_state_tracking_preset_sets_the_papers_fields_and_keeps_validation(family, tmp_path):
    """``from_preset("state_tracking")``: the paper's state-tracking Selective RoPE (theta 1, no gate, bias, conv 4);
    other kwargs win over the preset; wrong types and values are still refused by the strict config; it saves and
    loads like any config."""
    from selective_rope.configuration import PRESETS

    config = family.config_class.from_preset("state_tracking", **family.tiny)
    assert (config.position_embedding, config.temperature_type, config.temperature_theta) == ("selective_rope",
                                                                                              "rope", 1.0)
    assert (config.phase_gate, config.phase_bias, config.phase_conv_size) == (False, True, 4)
    assert {key: getattr(config, key) for key in PRESETS["state_tracking"]} == PRESETS["state_tracking"]
    assert family.config_class.from_preset("state_tracking", **family.tiny, phase_conv_size=0).phase_conv_size == 0
    with pytest.raises(InvalidConfigError, match="phase_gate"):
        family.config_class.from_preset("state_tracking", **family.tiny, phase_gate="false")
    with pytest.raises(InvalidConfigError, match="RoPE base"):
        family.config_class.from_preset("state_tracking", **family.tiny, temperature_theta=0.5)
    with pytest.raises(ValueError, match="unknown preset 'parity'.*state_tracking"):
        family.config_class.from_preset("parity", **family.tiny)
    config.save_pretrained(tmp_path)
    assert family.config_class.from_pretrained(tmp_path).to_dict() == config.to_dict()
