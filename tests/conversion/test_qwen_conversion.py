"""Qwen3.5 / Qwen3.5-MoE / Qwen3-Next checkpoints converted onto the hybrid family, against transformers' own models.

The sources are tiny random models built with transformers' classes (its PyTorch paths: ``torch_only_modeling``),
with the zero-centred norms, ``dt_bias`` and ``A_log`` randomised (their default initialisation leaves the norms at
zero, which would hide a layout mistake). Skipped where the installed transformers lacks these models.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import save_file

from selective_rope import SelectiveRopeHybridForCausalLM
from selective_rope.conversion.convert import convert
from selective_rope.conversion.qwen import torch_only_modeling
from selective_rope.conversion.retrofit import RetrofitOptions
from selective_rope.modeling import returned_cache


def has_model(package: str) -> bool:
    return importlib.util.find_spec(f"transformers.models.{package}") is not None


COMMON = dict(vocab_size=64, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
              linear_value_head_dim=8, linear_conv_kernel_dim=3, intermediate_size=48,
              layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
              pad_token_id=0, eos_token_id=1, bos_token_id=1, tie_word_embeddings=False)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24)
# name -> (transformers model package, config class, causal-LM class, extra config fields, saved as a
# vision-language checkpoint)
SOURCES = {
    "qwen3_next": ("qwen3_next", "Qwen3NextConfig", "Qwen3NextForCausalLM", {**MOE, "decoder_sparse_step": 2}, False),
    "qwen3_5": ("qwen3_5", "Qwen3_5TextConfig", "Qwen3_5ForCausalLM", {}, False),
    "qwen3_5_vl": ("qwen3_5", "Qwen3_5TextConfig", "Qwen3_5ForCausalLM", {}, True),
    "qwen3_5_moe": ("qwen3_5_moe", "Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", MOE, False),
}


def build_source(name: str, directory) -> torch.nn.Module:
    """A tiny random source saved in ``directory``; returns the source model (float32, eval)."""
    package, config_name, lm_name, extra, vision_language = SOURCES[name]
    if not has_model(package):
        pytest.skip(f"transformers {__import__('transformers').__version__} has no {package} model")
    modeling = torch_only_modeling(package)
    config_module = __import__(f"transformers.models.{package}.configuration_{package}", fromlist=[config_name])
    fields = {k: v for k, v in {**COMMON, **extra}.items()}
    config = getattr(config_module, config_name)(**fields)
    torch.manual_seed(0)
    model = getattr(modeling, lm_name)(config).float().eval()
    with torch.no_grad():  # the default initialisation leaves the (1 + w) norms at w = 0, dt_bias at 1
        for param_name, param in model.named_parameters():
            if param_name.endswith(("norm.weight", "layernorm.weight", "dt_bias", "A_log")):
                param.copy_(torch.randn_like(param) * 0.5)
    if not vision_language:
        model.save_pretrained(directory)
    else:  # the layout of a Qwen3_5ForConditionalGeneration checkpoint: the text model nested, vision and MTP beside
        state = {("model.language_model." + k.removeprefix("model.")) if k.startswith("model.") else k: v.contiguous()
                 for k, v in model.state_dict().items()}
        state["model.visual.patch_embed.proj.weight"] = torch.randn(8, 3, 2, 4, 4)
        state["mtp.fc.weight"] = torch.randn(32, 64)
        os.makedirs(directory, exist_ok=True)
        save_file(state, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
        from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5Config

        Qwen3_5Config(text_config=config.to_dict(), vision_config=dict(depth=1, hidden_size=16, num_heads=2,
                                                                          intermediate_size=16, out_hidden_size=32),
                      tie_word_embeddings=False).save_pretrained(directory)
    return model


def converted(name, tmp_path, selective: bool):
    source = build_source(name, tmp_path / "source")
    options = RetrofitOptions(selective=selective, forget_gate=False)
    report = convert(tmp_path / "source", tmp_path / "out", options, license="apache-2.0", progress=False,
                     tolerance=1e-5)
    model = SelectiveRopeHybridForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    return source, model, report


def ids(batch=2, length=12, seed=1):
    return torch.randint(2, 64, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("selective", [False, True], ids=["port", "selective"])
@pytest.mark.parametrize("name", sorted(SOURCES))
def test_converted_equals_source(name, selective, tmp_path):
    source, model, report = converted(name, tmp_path, selective)
    assert report.max_logit_difference <= 1e-5
    tokens = ids()
    with torch.no_grad():
        expected = source(tokens).logits
        torch.testing.assert_close(model(tokens).logits, expected, atol=1e-5, rtol=0)
        # cached decoding: a prefill, then one token at a time
        out = model(tokens[:, :5], use_cache=True)
        cache, steps = returned_cache(out), [out.logits]
        for t in range(5, tokens.shape[1]):
            out = model(tokens[:, t:t + 1], cache=cache, use_cache=True)
            cache = returned_cache(out)
            steps.append(out.logits)
        torch.testing.assert_close(torch.cat(steps, dim=1), expected, atol=1e-5, rtol=0)
        # left padding: the padded row's real tokens get the logits they have alone
        padded = torch.cat([torch.zeros(1, 4, dtype=torch.long), tokens[:1, :8]], dim=1)
        mask = torch.cat([torch.zeros(1, 4, dtype=torch.long), torch.ones(1, 8, dtype=torch.long)], dim=1)
        torch.testing.assert_close(model(padded, attention_mask=mask).logits[:, 4:], source(tokens[:1, :8]).logits,
                                   atol=1e-5, rtol=0)
        # greedy generate
        ours = model.generate(tokens[:, :4], max_new_tokens=6, do_sample=False, pad_token_id=0)
        theirs = source.generate(tokens[:, :4], max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert torch.equal(ours, theirs)
    card = (tmp_path / "out" / "README.md").read_text()
    assert "license: apache-2.0" in card
    assert ("vision tower" in card) == (name == "qwen3_5_vl")


def test_selective_retrofit_trains_the_phases_and_bf16_round_trips(tmp_path):
    _, model, _ = converted("qwen3_next", tmp_path, selective=True)
    model.train()
    tokens = ids()
    loss = model(tokens, labels=tokens).loss
    loss.backward()
    for kind in ("linear_attention", "full_attention"):
        layer = model.config.layer_types.index(kind)
        up = model.model.layers[layer].attn.rotary.phase_proj.up
        assert up.grad is not None and up.grad.abs().sum() > 0, kind
    model.save_pretrained(tmp_path / "bf16", model_card=False)
    bf16 = SelectiveRopeHybridForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.bfloat16)
    bf16.save_pretrained(tmp_path / "bf16")
    again = SelectiveRopeHybridForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.bfloat16)
    for (name, a), (_, b) in zip(bf16.state_dict().items(), again.state_dict().items(), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    norm = again.model.layers[0].attn_norm.weight
    assert norm.dtype == torch.bfloat16  # the (1 + w) norms stay in that form, exact in bf16


def test_plain_port_has_no_phase_parameters_and_vl_note(tmp_path):
    _, model, report = converted("qwen3_5_vl", tmp_path, selective=False)
    assert not any("phase" in name for name, _ in model.named_parameters())
    assert report.description.startswith("transformers qwen3_5")


@pytest.mark.skipif(importlib.util.find_spec("fla") is None, reason="flash-linear-attention is not installed")
def test_the_probe_runs_on_cpu_with_transformers_bound_to_fla(tmp_path):
    """With fla installed, importing transformers' Qwen3-Next code binds fla's Triton kernels (they fail on CPU
    tensors); the converter's probe still runs the source, on PyTorch ops. In a process of its own: importing fla
    re-registers mamba in transformers' Auto classes."""
    build_source("qwen3_next", tmp_path / "source")
    script = textwrap.dedent(f"""
        import torch, transformers.models.qwen3_next.modeling_qwen3_next as bound
        from selective_rope.conversion.convert import convert
        from selective_rope.conversion.qwen import torch_only_modeling
        from selective_rope.conversion.retrofit import RetrofitOptions

        def from_fla(value):
            return getattr(value, "__module__", None) and value.__module__.startswith("fla")

        def binds_fla(module):  # a module-level fla function (5.10) or one inside transformers' wrapper (5.24)
            for value in vars(module).values():
                cells = [c.cell_contents for c in getattr(value, "__closure__", None) or () if c.cell_contents]
                if from_fla(value) or any(from_fla(c) for c in cells):
                    return True
            return False

        print("binds_fla", binds_fla(bound))
        assert not binds_fla(torch_only_modeling("qwen3_next"))
        report = convert({str(tmp_path / 'source')!r}, {str(tmp_path / 'out')!r}, RetrofitOptions(forget_gate=False),
                         license="apache-2.0", progress=False, tolerance=1e-5)
        print("difference", report.max_logit_difference)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "difference" in result.stdout
    if "binds_fla True" not in result.stdout:  # the conversion ran, but there was nothing to keep it off
        pytest.skip("this transformers binds no fla kernels here (older releases bind them only with CUDA)")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == "selective_rope_hybrid"
