"""Selective RoPE's decoding overhead over NoPE as the model widens: GLA and Gated DeltaNet on the CPU.

The issue-21 comparisons (``bench_gla_cpu.py`` / ``bench_gated_deltanet_cpu.py --compare-only``) use hidden 256, where
a decoding step takes ~0.5 ms per layer and the rotary module's fixed cost per layer and token (~20 us through its
CPython entry, ~40 through ctypes: docs/cpu_performance.md, "Seventh round") is 4-8 % of it. That cost grows with the
hidden size times the phase projection's rank, a layer's with the hidden size squared. This script runs the same
interleaved decoding comparison (cached greedy steps after 256 tokens, NoPE and Selective RoPE of the same seed taking
turns, ratios paired by round) at each width: 256 is the issue-21 model itself, 1024 flash-linear-attention's 340M
recipes (the paper's width), both with 4 layers and a 1024-token vocabulary, fp32, batch 1. It reports; it has no
target.

Usage::

    python benchmarks/bench_decode_width_cpu.py           # -> benchmarks/results/decode_width_cpu.json
    python benchmarks/bench_decode_width_cpu.py --quick   # smoke run
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from selective_rope.configuration import SelectiveRopeGatedDeltaNetConfig, SelectiveRopeGLAConfig
from selective_rope.modeling.gated_deltanet import SelectiveRopeGatedDeltaNetForCausalLM
from selective_rope.modeling.gla import SelectiveRopeGLAForCausalLM

from harness.measure import decode_comparison, num_parameters
from harness.report import log, write_results
from harness.runner import configure, start_results

ROOT = Path(__file__).resolve().parents[1]  # the repository
DEFAULT_OUTPUT = ROOT / "benchmarks" / "results" / "decode_width_cpu.json"
SOURCES = ["benchmarks/bench_decode_width_cpu.py", "modeling/rotary.py", "kernels/rotary_cpu.py", "modeling/gla.py",
           "modeling/gated_deltanet.py", "benchmarks/harness/measure.py"]
SEED = 0
SHARED = {"num_hidden_layers": 4, "vocab_size": 1024, "use_short_conv": True}
FAMILIES = {  # per width: 256 as in the issue-21 benchmarks, 1024 as fla's 340M recipes (bench_models_gpu.py)
    "gla": (SelectiveRopeGLAConfig, SelectiveRopeGLAForCausalLM, {
        256: {"hidden_size": 256, "num_heads": 4},
        1024: {"hidden_size": 1024, "num_heads": 4, "expand_k": 0.5, "expand_v": 1.0, "hidden_ratio": 4}}),
    "gated_deltanet": (SelectiveRopeGatedDeltaNetConfig, SelectiveRopeGatedDeltaNetForCausalLM, {
        256: {"hidden_size": 256, "num_heads": 4, "head_dim": 64, "expand_v": 1.0},
        1024: {"hidden_size": 1024, "num_heads": 4, "head_dim": 256, "expand_v": 2.0, "use_gate": True,
               "hidden_ratio": 4}}),
}
PLANS = {
    "quick": {"contexts": [16], "rounds": 2, "steps_per_round": 2, "warmup": 1},
    "full": {"contexts": [256], "rounds": 30, "steps_per_round": 8, "warmup": 4},
}


def build(family: str, width: int, position_embedding: str) -> torch.nn.Module:
    config_class, model_class, widths = FAMILIES[family]
    torch.manual_seed(SEED)  # the same weights for both position embeddings, bar the rotary module's
    return model_class(config_class(**SHARED, **widths[width], position_embedding=position_embedding)).eval()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short smoke run (few rounds, 16 cached tokens)")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help=f"JSON path (default {DEFAULT_OUTPUT})")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: usable cores)")
    parser.add_argument("--max-wait", type=float, default=None, help="seconds in all to wait for a quiet machine")
    parser.add_argument("--max-redo", type=int, default=None, help="disturbed rounds run again per measurement")
    parser.add_argument("--widths", type=int, nargs="+", default=[256, 1024], choices=[256, 1024])
    args = parser.parse_args(argv)

    threads_before = torch.get_num_threads()
    try:
        threads, quiet = configure(args, SEED)
        plan = PLANS["quick" if args.quick else "full"]
        results = start_results("bench_decode_width_cpu", args, threads, ROOT, SOURCES, plan)
        start = time.perf_counter()
        rows = []
        for family in FAMILIES:
            for width in args.widths:
                models = {name: build(family, width, name) for name in ("nope", "selective_rope")}
                log(f"{family}, hidden {width}: {num_parameters(models['selective_rope']):,} parameters")
                quiet.wait()  # for other processes to go quiet, as the harness does before each section
                load_before = os.getloadavg()
                decode = decode_comparison(models, plan["contexts"], SHARED["vocab_size"], plan["rounds"],
                                           plan["steps_per_round"], plan["warmup"], "nope", quiet)
                rows.append({"family": family, "hidden_size": width, "config": FAMILIES[family][2][width],
                             "num_parameters": {n: num_parameters(m) for n, m in models.items()}, "decode": decode,
                             "load_average_before": load_before, "load_average_after": os.getloadavg()})
        results.update(rows=rows, contention={"quiet": quiet.summary()}, total_wall_s=time.perf_counter() - start)
        print_table(rows)
        write_results(args.output, results)
    finally:
        torch.set_num_threads(threads_before)
    return 0


def print_table(rows: list[dict]) -> None:
    print(f"{'family':>15} | {'hidden':>6} | {'context':>7} | {'nope ms':>8} | {'selective ms':>12} | "
          "x nope (wall), [q1-q3]")
    for row in rows:
        for decode in row["decode"]["rows"]:
            models = decode["models"]
            ratio = models["selective_rope"]["ratio_to_nope"]
            print(f"{row['family']:>15} | {row['hidden_size']:>6} | {decode['context']:>7} | "
                  f"{models['nope']['median_ms']:>8.2f} | {models['selective_rope']['median_ms']:>12.2f} | "
                  f"{ratio['median']:.3f} [{ratio['q1']:.3f}-{ratio['q3']:.3f}]")


if __name__ == "__main__":
    sys.exit(main())
