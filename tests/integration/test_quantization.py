"""Quantized loading (issue 41): ``from_pretrained(..., quantization_config=...)`` with torchao's int8 weight-only
quantization and optimum-quanto's int8 weights, for every family. Each quantized model must run (the compiled CPU
rotary kernel once read a torchao weight at address 0: a segmentation fault), compute exactly what the float32 model
with the dequantized weights computes, stay within a stated bound of the float32 model, and generate.

Both packages are in the ``test`` extra: these tests skip only where one is not installed."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from selective_rope.kernels import rotary_cpu

# Max |logit difference| to float32 over max |logit|, for the tiny test models (weights of std 0.2, width 32):
# measured 0.03-0.13 over the families and both methods (docs/quantization.md has the figures for larger models). The
# quantized layers compute exactly the dequantized model (checked below), so this is the int8 rounding of the weights.
RELATIVE_BOUND = 0.2


def torchao_config():
    quantization = pytest.importorskip("torchao.quantization")
    from transformers import TorchAoConfig

    return TorchAoConfig(quantization.Int8WeightOnlyConfig())


def quanto_config():
    pytest.importorskip("optimum.quanto")
    from transformers import QuantoConfig

    return QuantoConfig(weights="int8")


METHODS = {"torchao-int8": torchao_config, "quanto-int8": quanto_config}


def dequantized_weights(model) -> dict[str, torch.Tensor]:
    """``{module name: its weight dequantized to float32}`` for every quantized linear layer of ``model``."""
    weights = {}
    for name, module in model.named_modules():
        weight = getattr(module, "qweight", None)  # quanto's QLinear (its `weight` stays the float one)
        if weight is None:
            weight = getattr(module, "weight", None)
            if weight is None or type(weight) in (torch.Tensor, torch.nn.Parameter):
                continue
        weights[name] = weight.dequantize().float()
    return weights


def with_weights(model, weights: dict[str, torch.Tensor]):
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for name, weight in weights.items():
            reference.get_submodule(name).weight.copy_(weight)
    return reference


@pytest.mark.parametrize("method", METHODS)
@torch.no_grad()
def test_quantized_models_load_run_and_generate(family, method, tmp_path, monkeypatch):
    """The float32 model saved, then loaded quantized on the CPU (the compiled rotary kernel on): its logits are the
    float32 model's with the dequantized weights (the quantized layers compute them, within float32 rounding), within
    ``RELATIVE_BOUND`` of the float32 model's, and its greedy generation is that model's too."""
    config = METHODS[method]()
    monkeypatch.setenv(rotary_cpu.ENV_SWITCH, "1")
    model = family.lm_class(family.config_class(**family.tiny)).eval()
    model.save_pretrained(tmp_path)
    quantized = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=config, device_map="cpu")
    weights = dequantized_weights(quantized)
    assert len(weights) >= 4 * family.tiny["num_hidden_layers"], sorted(weights)  # it did quantize
    reference = with_weights(model, weights)
    ids = torch.randint(3, family.tiny["vocab_size"], (2, 12))
    logits = quantized(ids).logits
    torch.testing.assert_close(logits, reference(ids).logits, rtol=1e-4, atol=1e-4)
    full = model(ids).logits
    assert (logits - full).abs().max() <= RELATIVE_BOUND * full.abs().max()
    prompt = ids[:, :5]
    generated = quantized.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert generated.shape == (2, 11)
    assert torch.equal(generated, reference.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0))
