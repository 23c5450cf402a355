"""Checkpoints of the paper's own code converted into our families (issue 24), checked against the per-token reference
of the official models in ``official_reference.py`` (tiny checkpoints in the official format, random values)."""

from __future__ import annotations

import importlib
import json

import pytest
import torch
from official_reference import official_config, official_logits, write_official_checkpoint
from transformers import AutoModelForCausalLM

from selective_rope import (
    SelectiveRopeFoXForCausalLM,
    SelectiveRopeGatedDeltaNetForCausalLM,
    SelectiveRopeGLAForCausalLM,
)
from selective_rope.conversion import ConversionError, RetrofitOptions, convert
from selective_rope.modeling import returned_cache

convert_module = importlib.import_module("selective_rope.conversion.convert")  # the package exports the function
TOL = dict(atol=1e-4, rtol=0)
CLASSES = {"gla": SelectiveRopeGLAForCausalLM, "gated_deltanet": SelectiveRopeGatedDeltaNetForCausalLM,
           "transformer": SelectiveRopeFoXForCausalLM}

SELECTIVE = {
    # the official default parametrisation (dense low-rank), a learned convolution with SiLU, a head gate, a bias
    "gla-dense": ("gla", dict(temp_theta=10000, phi_parametrization="low-rank", phi_proj_rank=6, d_conv=3,
                              conv_act="silu", use_gate=True, gate_parametrization="standard", use_bias=True)),
    # full rank, skip_conv, a per-channel ("gla") gate of rank 4, the rfa temperature
    "gla-full-skip": ("gla", dict(temp_type="rfa", temp_theta=0.9, temp_max=2.0, phi_parametrization="full-rank",
                                  skip_conv=True, conv_act="silu", use_gate=True, gate_parametrization="gla",
                                  gate_low_rank_dim=4)),
    "gated_deltanet-dense-skip": ("gated_deltanet", dict(temp_theta=100, phi_proj_rank=5, skip_conv=True,
                                                         use_gate=True, gate_parametrization="low-rank",
                                                         gate_low_rank_dim=3, use_bias=True, use_triton=True,
                                                         fuse_gate=True)),
    "transformer-full-swish": ("transformer", dict(temp_theta=1000, phi_parametrization="full-rank", d_conv=2,
                                                   conv_act="swish", use_bias=True)),
}


# Model options besides the position embedding (the GLA's gate_logit_normalizer is read by the official model).
MODEL_CHANGES = {"gla-full-skip": dict(gate_logit_normalizer=4, clamp_min=-0.05)}


def selective_source(directory, case: str) -> tuple[dict, dict]:
    model_type, options = SELECTIVE[case]
    config = official_config(model_type, {"type": "selective_rope", **options}, **MODEL_CHANGES.get(case, {}))
    return config, write_official_checkpoint(directory, config)


def ids_batch(length: int = 20, batch: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, 61, (batch, length), generator=torch.Generator().manual_seed(seed))


def assert_matches_reference(model, config, tensors, ids):
    with torch.no_grad():
        logits = model(ids).logits
    for row in range(ids.shape[0]):
        torch.testing.assert_close(logits[row].double(), official_logits(config, tensors, ids[row]), **TOL)


@pytest.mark.parametrize("case", sorted(SELECTIVE))
def test_selective_rope_sources_are_ported_exactly(case, tmp_path):
    """Converted, the official model's own Selective RoPE reproduces the per-token reference of the official math
    (full forward, a left-padded batch row by row, cached decoding), and the converter's own probe agreed."""
    config, tensors = selective_source(tmp_path / "source", case)
    report = convert(tmp_path / "source", tmp_path / "out", progress=False)
    assert report.max_logit_difference <= 1e-4 and report.reference.startswith("official Selective RoPE math")
    assert report.new_tensors == [] and report.source_tensors == len(tensors)

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(model) is CLASSES[config["model_type"]]
    options = config["position_embedding"]
    ours = model.config
    assert ours.phase_proj == {"low-rank": "dense_low_rank", "full-rank": "full_rank"}[
        options.get("phi_parametrization", "low-rank")]
    assert ours.phase_conv_type == ("difference" if options.get("skip_conv") else "learned")
    assert ours.phase_gate == options.get("use_gate", False) and ours.phase_bias == options.get("use_bias", False)
    if config["model_type"] == "transformer":
        assert ours.use_forget_gate is False  # the official attention has none
    ids = ids_batch()
    assert_matches_reference(model, config, tensors, ids)

    # A left-padded batch: each row is the reference of that row alone (the official layers share a phase across it).
    short = ids[1, :9]
    padded = torch.cat([torch.zeros(11, dtype=torch.long), short])[None]
    mask = (padded != 0).long()
    with torch.no_grad():
        batch_logits = model(torch.cat([ids[:1], padded]), attention_mask=torch.cat([torch.ones_like(mask), mask]))
    torch.testing.assert_close(batch_logits.logits[1, 11:].double(), official_logits(config, tensors, short), **TOL)

    # Cached decoding: a prefill, single tokens, then a multi-token call (the official skip_conv cache restarts the
    # difference at every call; ours continues it).
    with torch.no_grad():
        out = model(ids[:, :8], use_cache=True)
        steps, cache = [out.logits], returned_cache(out)
        for t in range(8, 12):
            out = model(ids[:, t:t + 1], past_key_values=cache, use_cache=True)
            steps.append(out.logits)
        steps.append(model(ids[:, 12:], past_key_values=cache, use_cache=True).logits)
    for row in range(2):
        torch.testing.assert_close(torch.cat(steps, 1)[row].double(), official_logits(config, tensors, ids[row]), **TOL)

    card = (tmp_path / "out" / "README.md").read_text()
    assert "the paper's official" in card and "intended math" in card and "license: mit" in card
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert saved["model_type"].startswith("selective_rope_") and "temp_type" not in json.dumps(saved)


@pytest.mark.parametrize("model_type, position, changes", [
    ("gla", {"type": "nope"}, dict(num_kv_heads=1, gate_logit_normalizer=8)),  # GQA
    ("transformer", {"type": "rope", "theta": 10000}, dict(qk_norm=True, norm_eps=1e-5, num_kv_heads=2)),
    ("gated_deltanet", {"type": "rope", "theta": 500, "partial_rope_ratio": 0.5}, dict(use_short_conv=False)),
], ids=["gla-nope-gqa", "transformer-rope-qk-norm", "gated_deltanet-rope"])
def test_rope_and_nope_sources_are_retrofitted(model_type, position, changes, tmp_path):
    """Official RoPE / NoPE checkpoints get Selective RoPE starting as exactly their own rotation, as other sources
    do; the converted model matches the per-token reference of the official RoPE / NoPE model."""
    config = official_config(model_type, position, **changes)
    tensors = write_official_checkpoint(tmp_path / "source", config)
    report = convert(tmp_path / "source", tmp_path / "out", RetrofitOptions(phase_proj="dense_low_rank",
                                                                             phase_conv_type="difference"),
                     progress=False)
    assert report.max_logit_difference <= 1e-4
    assert report.reference.startswith("RoPE twin" if position["type"] == "rope" else "NoPE twin")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert model.config.position_embedding == "selective_rope" and model.config.phase_bias == (position["type"] ==
                                                                                                "rope")
    assert model.config.phase_proj == "dense_low_rank" and model.config.phase_conv_type == "difference"
    if model_type == "transformer":
        assert model.config.use_forget_gate is False
    assert_matches_reference(model, config, tensors, ids_batch())
    if "partial_rope_ratio" in position:
        assert "partial_rope_ratio" in (tmp_path / "out" / "README.md").read_text()


@pytest.mark.parametrize("model_type, position, changes, options, message", [
    ("gla", dict(type="selective_rope"), dict(num_kv_heads=1), None, "num_kv_heads=1"),
    ("gla", dict(type="selective_rope", phi_parametrization="block"), {}, None, "phi_parametrization='block'"),
    ("gla", dict(type="selective_rope", rotary_dim=8), {}, None, "rotary_dim=8"),
    ("gla", dict(type="selective_rope", temp_type="gaussian"), {}, None, "temp_type='gaussian'"),
    ("gla", dict(type="selective_rope", gate_parametrization="mlp"), {}, None, "gate_parametrization='mlp'"),
    ("gla", dict(type="selective_rope", conv_act="relu"), {}, None, "conv_act='relu'"),
    ("gla", dict(type="alibi"), {}, None, "position_embedding.type='alibi'"),
    ("gla", dict(type="rope"), {}, None, "position_embedding.type='rope'"),
    ("gla", dict(type="nope"), dict(norm_q=True), None, "norm_q=True"),
    ("gla", dict(type="nope"), dict(feature_map="elu"), None, "feature_map='elu'"),
    ("transformer", dict(type="selective_rope"), dict(qk_norm=True, norm_eps=1e-5), None, "qk_norm=True"),
    ("transformer", dict(type="rope"), dict(qk_norm=True), None, "norm_eps=1e-06"),
    ("transformer", dict(type="nope"), dict(window_size=8), None, "window_size=8"),
    ("gated_deltanet", dict(type="selective_rope"), {}, RetrofitOptions(phase_gate_type="channel"), "phase_gate_type"),
])
def test_unsupported_official_options_are_refused_by_name(model_type, position, changes, options, message, tmp_path):
    config = official_config(model_type, position, **changes)
    write_official_checkpoint(tmp_path / "source", config)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        convert(tmp_path / "source", tmp_path / "out", options, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["source"]  # nothing written


def test_a_wrong_mapping_fails_the_probe(tmp_path, monkeypatch):
    """The probe compares with the official math on the source's own tensors: a converter mapping the phase bias
    wrongly (here: negated) is caught, and nothing is left behind."""
    selective_source(tmp_path / "source", "gla-dense")
    official_tensor = convert_module.official_tensor
    monkeypatch.setattr(convert_module, "official_tensor", lambda name, tensor, half: (
        -official_tensor(name, tensor, half) if name.endswith("phase_bias") else official_tensor(name, tensor, half)))
    with pytest.raises(ConversionError, match="official Selective RoPE math"):
        convert(tmp_path / "source", tmp_path / "out", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["source"]


def test_fla_checkpoints_of_the_same_model_type_are_still_fla(tmp_path):
    """Without the `position_embedding` dict a `gla` config is flash-linear-attention's (NoPE), as before; a
    `transformer` without it is neither (fla's Transformer is not supported)."""
    config = official_config("gla", {"type": "nope"})
    tensors = write_official_checkpoint(tmp_path / "source", config)
    del config["position_embedding"]
    (tmp_path / "source" / "config.json").write_text(json.dumps(config))
    report = convert(tmp_path / "source", tmp_path / "out", progress=False)
    assert report.description.startswith("flash-linear-attention gla")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert_matches_reference(model, {**config, "position_embedding": {"type": "nope"}}, tensors, ids_batch(12))

    config = official_config("transformer", {"type": "nope"})
    write_official_checkpoint(tmp_path / "fla_transformer", config)
    del config["position_embedding"]
    (tmp_path / "fla_transformer" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported source architecture 'transformer'.*the paper's code"):
        convert(tmp_path / "fla_transformer", tmp_path / "out2", progress=False)
