"""How far int8 weight quantization moves the logits, per family and method (docs/quantization.md).

For each family a float32 model (hidden 256, 4 layers, vocab 2048, the default initialisation with std 0.02, phase
parameters as initialised) is saved and loaded back with ``from_pretrained(..., quantization_config=...,
device_map="cpu")``: torchao's int8 weight-only quantization (``TorchAoConfig(Int8WeightOnlyConfig())``) and
optimum-quanto's int8 weights (``QuantoConfig(weights="int8")``). On 4 rows of 256 random tokens it records the max
and mean |logit difference| to the float32 model, the largest |logit| (for scale), the fraction of positions whose
argmax agrees, and the max difference to the float32 model carrying the dequantized weights (what the quantized
layers should compute: rounding only). Random weights, not a trained model: the figures say how large the
quantization error is against logits of this scale, not what it does to a trained model's quality.

Run: ``python benchmarks/quantization_logits.py``; writes ``benchmarks/results/quantization_logits.json``
(``--output`` to change it). ~2 minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from transformers import AutoModelForCausalLM, QuantoConfig, TorchAoConfig  # noqa: E402

from selective_rope.families import FAMILIES  # noqa: E402

SIZES = {
    "gla": dict(hidden_size=256, num_hidden_layers=4, num_heads=4, expand_k=0.5, expand_v=1.0),
    "gated_deltanet": dict(hidden_size=256, num_hidden_layers=4, num_heads=4, head_dim=64, expand_v=2.0),
    "fox": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=688),
}
COMMON = dict(vocab_size=2048, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def methods():
    from torchao.quantization import Int8WeightOnlyConfig

    return {"torchao-int8-weight-only": lambda: TorchAoConfig(Int8WeightOnlyConfig()),
            "quanto-int8": lambda: QuantoConfig(weights="int8")}


def dequantized_reference(model, quantized):
    """``model`` with every weight ``quantized`` holds quantized replaced by its dequantized values."""
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for name, module in quantized.named_modules():
            weight = getattr(module, "qweight", None)
            if weight is None:
                weight = getattr(module, "weight", None)
                if weight is None or type(weight) in (torch.Tensor, torch.nn.Parameter):
                    continue
            reference.get_submodule(name).weight.copy_(weight.dequantize().float())
    return reference


@torch.no_grad()
def measure(family: str, method: str, make_config, ids: torch.Tensor) -> dict:
    spec = FAMILIES[family]
    torch.manual_seed(0)
    model = spec.lm_class(spec.config_class(**COMMON, **SIZES[family])).eval()
    with tempfile.TemporaryDirectory() as directory:
        model.save_pretrained(directory)
        quantized = AutoModelForCausalLM.from_pretrained(directory, quantization_config=make_config(),
                                                         device_map="cpu")
    full, logits = model(ids).logits, quantized(ids).logits
    reference = dequantized_reference(model, quantized)(ids).logits
    difference = (logits - full).abs()
    return {"family": family, "method": method, "max_abs_logit_difference": difference.max().item(),
            "mean_abs_logit_difference": difference.mean().item(), "max_abs_logit": full.abs().max().item(),
            "argmax_agreement": (logits.argmax(-1) == full.argmax(-1)).float().mean().item(),
            "max_difference_to_dequantized_float32": (logits - reference).abs().max().item()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, default=REPO_ROOT / "benchmarks/results/quantization_logits.json")
    args = parser.parse_args()
    ids = torch.randint(3, COMMON["vocab_size"], (4, 256), generator=torch.Generator().manual_seed(1))
    rows = []
    for family in SIZES:
        for method, make_config in methods().items():
            start = time.perf_counter()
            row = measure(family, method, make_config, ids)
            rows.append(row)
            print(f"{family:15s} {method:25s} max |dlogit| {row['max_abs_logit_difference']:.2e} "
                  f"(max |logit| {row['max_abs_logit']:.2f}), mean {row['mean_abs_logit_difference']:.2e}, argmax "
                  f"agreement {row['argmax_agreement']:.4f}, to dequantized fp32 "
                  f"{row['max_difference_to_dequantized_float32']:.1e} ({time.perf_counter() - start:.0f} s)",
                  flush=True)
    from importlib.metadata import version

    import torchao
    from optimum import quanto  # noqa: F401

    record = {"torch": torch.__version__, "torchao": torchao.__version__, "optimum-quanto": version("optimum-quanto"),
              "transformers": version("transformers"), "threads": torch.get_num_threads(), "rows": rows}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
