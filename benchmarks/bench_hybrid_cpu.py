"""CPU benchmark: a converted Qwen3.5 (the hybrid family) against transformers' own Qwen3.5, side by side.

A small random Qwen3.5 text model (transformers' ``Qwen3_5ForCausalLM`` on its PyTorch paths: fla's Triton kernels
cannot run on a CPU, see ``conversion/qwen.py``) is saved and converted twice with ``selective-rope convert``: as a
plain port (``position_embedding="rope"`` in the attention layers, ``"nope"`` in the Gated DeltaNet layers) and as a
Selective RoPE retrofit. The three models then run, interleaved round by round (the harness ``benchmarks/harness``:
medians, ratios paired by round, waiting for a quiet machine), in float32 under ``torch.inference_mode``:

1. prefill (``use_cache=False``, batch 1) at several lengths;
2. cached greedy decoding (ms per token) after a context.

Targets: the port at most 1.05x transformers' time, Selective RoPE at most 1.15x.

Usage::

    python benchmarks/bench_hybrid_cpu.py            # a few minutes on a quiet 2-core machine
    python benchmarks/bench_hybrid_cpu.py --quick    # smoke run
    python benchmarks/bench_hybrid_cpu.py --output benchmarks/results/hybrid_vs_qwen3_5_cpu.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from selective_rope import SelectiveRopeHybridForCausalLM
from selective_rope.conversion.convert import convert
from selective_rope.conversion.qwen import torch_only_modeling
from selective_rope.conversion.retrofit import RetrofitOptions

from harness.machine import Quiet, device_info
from harness.measure import decode_comparison, num_parameters, prefill_comparison

VOCAB = 2048
SOURCE = dict(vocab_size=VOCAB, hidden_size=256, num_hidden_layers=8, intermediate_size=768,
              num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_num_key_heads=4,
              linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64,
              layer_types=["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"],
              tie_word_embeddings=False)
PLANS = {
    "quick": dict(prefill=[256], prefill_rounds=3, contexts=[128], decode_rounds=3, steps=4, warmup=2),
    "full": dict(prefill=[512, 2048], prefill_rounds=7, contexts=[256, 2048], decode_rounds=15, steps=8, warmup=4),
}
TARGETS = {"port": 1.05, "selective_rope": 1.15}


def build_models(directory: Path) -> dict[str, torch.nn.Module]:
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    modeling = torch_only_modeling("qwen3_5")
    torch.manual_seed(0)
    source = modeling.Qwen3_5ForCausalLM(Qwen3_5TextConfig(**SOURCE)).float().eval()
    source.save_pretrained(directory / "source")
    models = {"transformers": source}
    for name, selective in (("port", False), ("selective_rope", True)):
        convert(directory / "source", directory / name, RetrofitOptions(selective=selective, forget_gate=False),
                license="apache-2.0", progress=False)
        models[name] = SelectiveRopeHybridForCausalLM.from_pretrained(directory / name, dtype=torch.float32).eval()
    return models


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()
    plan = PLANS["quick" if args.quick else "full"]
    quiet = Quiet(max_wait_s=120.0, max_redo=2)
    with tempfile.TemporaryDirectory() as scratch:
        models = build_models(Path(scratch))
        print(f"models: {num_parameters(models['port']) / 1e6:.1f}M parameters, layers {SOURCE['layer_types']}")
        prefill = prefill_comparison(models, plan["prefill"], VOCAB, plan["prefill_rounds"], "transformers", quiet)
        decode = decode_comparison(models, plan["contexts"], VOCAB, plan["decode_rounds"], plan["steps"],
                                   plan["warmup"], "transformers", quiet)
    result = {"benchmark": "hybrid_vs_qwen3_5_cpu", "device": device_info(torch.get_num_threads()),
              "source": SOURCE, "plan": plan, "targets_over_transformers": TARGETS, "prefill": prefill,
              "decode": decode, "contention": quiet.summary()}
    if args.output is not None:
        args.output.write_text(json.dumps(result, indent=2) + "\n")
        print(f"saved {args.output}")


if __name__ == "__main__":
    main()
