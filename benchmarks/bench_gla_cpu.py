"""CPU benchmark of SelectiveRopeGLA and its pure-PyTorch GLA kernels.

Measures, on the CPU, in float32 and under ``torch.inference_mode``:

1. prefill throughput (tokens/s) of a small GLA language model at several sequence lengths;
2. the chunk-parallel GLA op (``chunk_gla``) against flash-linear-attention's per-token reference
   (``fla.ops.gla.naive.naive_recurrent_gla``), forward only;
3. cached decoding latency (ms/token) after a short and a long context: a recurrent model should not slow
   down with the context length;
4. the prefill overhead of Selective RoPE (and of fixed RoPE) over NoPE for the same model.
5. Selective RoPE against NoPE, decode (ms/token after 256 and 4096 tokens) and prefill (2048 and 8192 tokens),
   interleaved, ratios paired by round (target <= 1.10x each); ``--compare-only`` runs this section alone.

Every target is reported as ``{"value", "target", "met"}``. Timings are medians over repeats after a warm-up
(``time.perf_counter``). Whatever is compared (chunk vs naive, the two decode contexts, the three position
embeddings) is measured *interleaved*: the variants take turns inside each round, so a change of machine load
hits all of them alike.

Other processes on the machine: with ``torch.set_num_threads(cores)``, one other busy process makes every
multi-threaded op wait for a descheduled OpenMP thread, and timings inflate by 10-100x. The script therefore
watches ``/proc/stat``: it waits (within ``--max-wait`` seconds in all) for the machine to be quiet before each
section, and a round during which other processes kept more than half a core busy is discarded and run again (at
most ``--max-redo`` times per measurement). What it saw is recorded under ``contention`` in the JSON. The
timing and load-watching infrastructure is shared with the other families' benchmarks: the harness
``benchmarks/harness`` runs this script's spec (``SPEC``).

Usage::

    python benchmarks/bench_gla_cpu.py               # full run (about a minute on a quiet 2-core machine)
    python benchmarks/bench_gla_cpu.py --quick       # smoke run (a few seconds)
    python benchmarks/bench_gla_cpu.py --output benchmarks/results/gla_cpu.json
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from selective_rope.configuration import SelectiveRopeGLAConfig
from selective_rope.kernels.gla_torch import chunk_gla

from harness.machine import Quiet
from harness.report import log
from harness.runner import (
    FamilyBenchmark,
    Run,
    prefill_section,
    print_prefill_section,
    run_benchmark,
    script_paths,
    selective_vs_nope_comparison,
    with_compare_plans,
)
from harness.timing import target, timed_rounds

# the repository root; benchmarks/results/gla_cpu.json, and gla_selective_vs_nope_cpu.json for --compare-only
PATHS = script_paths(__file__, "gla")
SOURCES = ["kernels/gla_torch.py", "modeling/gla.py", "configuration/gla.py", "benchmarks/bench_gla_cpu.py"]

SEED = 0
MODEL_CONFIG = {
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_heads": 4,
    "vocab_size": 1024,
    "use_short_conv": True,
}
GLA_OP_SHAPE = {"B": 1, "H": 4, "K": 64, "V": 64}

TARGET_CHUNK_SPEEDUP = 5.0  # chunk_gla at least 5x faster than the per-token reference at T=2048
TARGET_DECODE_RATIO = 1.2  # ms/token at context 4096 at most 1.2x that at context 256
TARGET_ROPE_OVERHEAD = 1.15  # (Selective) RoPE prefill at most 1.15x NoPE prefill


# --------------------------------------------------------------------------------------------------------------------
# inputs
# --------------------------------------------------------------------------------------------------------------------
def gla_inputs(T: int, seed: int):
    B, H, K, V = (GLA_OP_SHAPE[d] for d in "BHKV")
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=generator)
    k = torch.randn(B, T, H, K, generator=generator)
    v = torch.randn(B, T, H, V, generator=generator)
    # the model's gate: logsigmoid(.) / gate_logit_normalizer (16), always <= 0
    gk = F.logsigmoid(torch.randn(B, T, H, K, generator=generator)) / 16
    return q, k, v, gk


def rotary_inputs(T: int):
    cfg = SelectiveRopeGLAConfig(**MODEL_CONFIG)
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(1, T, cfg.hidden_size, generator=generator)
    q = torch.randn(1, T, cfg.num_heads, cfg.head_k_dim, generator=generator)
    k = torch.randn(1, T, cfg.num_kv_heads, cfg.head_k_dim, generator=generator)
    return x, q, k


# --------------------------------------------------------------------------------------------------------------------
# 2. chunk-parallel vs per-token GLA op
# --------------------------------------------------------------------------------------------------------------------
def bench_gla_op(lengths: list[int], target_len: int, rounds: int, quiet: Quiet) -> dict:
    # the oracle; imported lazily (slow import)
    from fla.ops.gla.naive import naive_recurrent_gla

    rows = []
    for T in lengths:
        q, k, v, gk = gla_inputs(T, seed=T)
        with torch.inference_mode():
            o_chunk, _ = chunk_gla(q, k, v, gk)
            o_naive, _ = naive_recurrent_gla(q, k, v, gk)
            max_abs_err = (o_chunk - o_naive).abs().max().item()
            args = (q, k, v, gk)
            stats = timed_rounds({"chunk_gla": lambda a=args: chunk_gla(*a),
                                  "naive_recurrent_gla": lambda a=args: naive_recurrent_gla(*a)},
                                 rounds=rounds, quiet=quiet, warmup=2)
        chunk, naive = stats["chunk_gla"], stats["naive_recurrent_gla"]
        speedup = naive["median_s"] / chunk["median_s"]
        rows.append({"seq_len": T, "chunk_gla": chunk, "naive_recurrent_gla": naive, "speedup": round(speedup, 2),
                     "speedup_min_over_min": round(naive["min_s"] / chunk["min_s"], 2),
                     "max_abs_err_vs_naive": max_abs_err})
        log(f"  GLA op T={T:5d}: chunk_gla {chunk['median_s'] * 1e3:8.2f} ms | naive_recurrent_gla "
            f"{naive['median_s'] * 1e3:8.1f} ms | speed-up {speedup:6.1f}x | max|diff| {max_abs_err:.1e}")
    at_target = next(r for r in rows if r["seq_len"] == target_len)
    return {"shape": GLA_OP_SHAPE, "dtype": "float32", "chunk_size": 64, "gk": "logsigmoid(randn) / 16",
            "rounds": rounds, "interleaved": True, "rows": rows, "target_seq_len": target_len,
            "speedup_target": target(at_target["speedup"], TARGET_CHUNK_SPEEDUP, higher_is_better=True)}


# --------------------------------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------------------------------
def print_sections(results: dict) -> None:
    print_prefill_section(results, 1)

    op = results["gla_op"]
    log(f"2. GLA op forward, B={op['shape']['B']} H={op['shape']['H']} K=V={op['shape']['K']} fp32: "
        f"chunk_gla vs naive_recurrent_gla ({op['rounds']} interleaved rounds)")
    log(f"   {'T':>6} | {'chunk ms':>10} | {'chunk min':>9} | {'naive ms':>10} | {'speed-up':>9} | {'max|diff|':>9} | "
        f"{'chunk page faults/call':>22}")
    for row in op["rows"]:
        log(f"   {row['seq_len']:>6} | {row['chunk_gla']['median_s'] * 1e3:>10.2f} | "
            f"{row['chunk_gla']['min_s'] * 1e3:>9.2f} | "
            f"{row['naive_recurrent_gla']['median_s'] * 1e3:>10.1f} | {row['speedup']:>8.1f}x | "
            f"{row['max_abs_err_vs_naive']:>9.1e} | {row['chunk_gla']['minor_page_faults_per_call']:>22.0f}")


# --------------------------------------------------------------------------------------------------------------------
# the spec
# --------------------------------------------------------------------------------------------------------------------
def sections(run: Run) -> list:
    plan = run.plan
    return [("prefill", "1. prefill throughput", lambda: prefill_section(SPEC, run)),
            ("gla_op", "2. chunk_gla vs naive_recurrent_gla",
             lambda: bench_gla_op(plan["op_lengths"], plan["op_target"], plan["op_rounds"], run.quiet))]


SPEC = FamilyBenchmark(
    name="bench_gla_cpu", title="GLA CPU benchmark", family="gla", description=__doc__.split("\n\n")[0],
    model_config=MODEL_CONFIG, seed=SEED, root=PATHS.root, sources=SOURCES, default_output=PATHS.default_output,
    plans=with_compare_plans({
        "quick": {"prefill_lengths": [256, 1024], "prefill_repeats": 3, "op_lengths": [512, 2048], "op_target": 2048,
                  "op_rounds": 3, "decode_contexts": [256, 4096], "decode_steps": 8, "decode_steps_per_round": 4,
                  "decode_warmup": 2, "overhead_len": 1024, "overhead_rounds": 3},
        "full": {"prefill_lengths": [256, 1024, 4096], "prefill_repeats": 7, "op_lengths": [512, 2048],
                 "op_target": 2048, "op_rounds": 9, "decode_contexts": [256, 4096], "decode_steps": 32,
                 "decode_steps_per_round": 8, "decode_warmup": 4, "overhead_len": 2048, "overhead_rounds": 15},
    }),
    sections=sections, print_sections=print_sections,
    targets=lambda results, plan: {
        f"chunk_gla speed-up vs naive at T={plan['op_target']}": results["gla_op"]["speedup_target"]},
    rotary_inputs=rotary_inputs,
    model_details=lambda model: {"head_k_dim": model.config.head_k_dim, "head_v_dim": model.config.head_v_dim,
                                 "expand_k": model.config.expand_k, "expand_v": model.config.expand_v,
                                 "conv_size": model.config.conv_size},
    model_line=lambda cfg: (
        f"model: hidden {cfg['hidden_size']}, layers {cfg['num_hidden_layers']}, heads {cfg['num_heads']}, "
        f"vocab {cfg['vocab_size']}, short conv {cfg['use_short_conv']}, key/value head dims "
        f"{cfg['head_k_dim']}/{cfg['head_v_dim']}, {cfg['num_parameters']:,} params, fp32, batch 1"),
    decode_goal=TARGET_DECODE_RATIO, overhead_goal=TARGET_ROPE_OVERHEAD,
    comparison=selective_vs_nope_comparison(PATHS.compare_output),
)


if __name__ == "__main__":
    sys.exit(run_benchmark(SPEC))
