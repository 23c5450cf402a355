"""CPU benchmark of SelectiveRopeGLA and its pure-PyTorch GLA kernels.

Measures, on the CPU, in float32 and under ``torch.inference_mode``:

1. prefill throughput (tokens/s) of a small GLA language model at several sequence lengths;
2. the chunk-parallel GLA op (``chunk_gla``) against flash-linear-attention's per-token reference
   (``fla.ops.gla.naive.naive_recurrent_gla``), forward only;
3. cached decoding latency (ms/token) after a short and a long context: a recurrent model should not slow
   down with the context length;
4. the prefill overhead of Selective RoPE (and of fixed RoPE) over NoPE for the same model.
5. Selective RoPE against NoPE, decode (ms/token after 256 and 4096 tokens) and prefill (2048 and 8192 tokens),
   interleaved, ratios paired by round (target <= 1.10x each); ``--compare-only`` runs this section alone
   (``selective-rope bench --full --compare``).

Every target is reported as ``{"value", "target", "met"}``. Timings are medians over repeats after a warm-up
(``time.perf_counter``). Whatever is compared (chunk vs naive, the two decode contexts, the three position
embeddings) is measured *interleaved*: the variants take turns inside each round, so a change of machine load
hits all of them alike.

Other processes on the machine: with ``torch.set_num_threads(cores)``, one other busy process makes every
multi-threaded op wait for a descheduled OpenMP thread, and timings inflate by 10-100x. The script therefore
watches ``/proc/stat``: it waits (within ``--max-wait`` seconds in all) for the machine to be quiet before each
section, and a round during which other processes kept more than half a core busy is discarded and run again (at
most ``--max-redo`` times per measurement). What it saw is recorded under ``contention`` in the JSON. The
timing and load-watching infrastructure is shared with the other families' benchmarks (``benchmarks/common.py``).

Usage::

    python benchmarks/bench_gla_cpu.py               # full run (about a minute on a quiet 2-core machine)
    python benchmarks/bench_gla_cpu.py --quick       # smoke run (a few seconds)
    python benchmarks/bench_gla_cpu.py --output benchmarks/results/gla_cpu.json
"""
from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F
from common import (
    COMPARE_PLANS,
    RESULTS_DIR,
    add_common_arguments,
    configure,
    decode_contexts,
    decode_result,
    finish,
    log,
    num_parameters,
    position_embedding_overhead,
    prefill_rows,
    print_decode,
    print_footer,
    print_header,
    print_overhead,
    print_prefill_rows,
    print_selective_vs_nope,
    profile_overhead,
    run_compare_only,
    run_sections,
    selective_vs_nope,
    start_results,
    target,
    timed_rounds,
    write_results,
)

from selective_rope import SelectiveRopeGLAConfig, SelectiveRopeGLAForCausalLM
from selective_rope.kernels.gla_torch import chunk_gla

DEFAULT_OUTPUT = RESULTS_DIR / "gla_cpu.json"
COMPARE_OUTPUT = RESULTS_DIR / "gla_selective_vs_nope_cpu.json"  # --compare-only
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
def build_model(position_embedding: str) -> SelectiveRopeGLAForCausalLM:
    torch.manual_seed(SEED)
    config = SelectiveRopeGLAConfig(position_embedding=position_embedding, **MODEL_CONFIG)
    return SelectiveRopeGLAForCausalLM(config).eval()


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
# 1. prefill throughput
# --------------------------------------------------------------------------------------------------------------------
def bench_prefill(lengths: list[int], repeats: int) -> dict:
    rows = prefill_rows(build_model("selective_rope"), lengths, MODEL_CONFIG["vocab_size"], repeats, use_cache=True)
    return {"position_embedding": "selective_rope", "batch_size": 1, "use_cache": True, "warmup": 1, "rows": rows}


# --------------------------------------------------------------------------------------------------------------------
# 2. chunk-parallel vs per-token GLA op
# --------------------------------------------------------------------------------------------------------------------
def bench_gla_op(lengths: list[int], target_len: int, rounds: int) -> dict:
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
                                 rounds=rounds, warmup=2)
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
# 3. decode latency vs context length
# --------------------------------------------------------------------------------------------------------------------
def bench_decode(contexts: list[int], steps: int, steps_per_round: int, warmup_steps: int) -> dict:
    """Prefill each context with ``use_cache=True``, then decode single tokens greedily, the contexts taking turns
    (``steps_per_round`` steps each)."""
    decoded = decode_contexts(build_model("selective_rope"), contexts, MODEL_CONFIG["vocab_size"], steps,
                              steps_per_round, warmup_steps)
    return decode_result(decoded, steps_per_round, warmup_steps, TARGET_DECODE_RATIO)


# --------------------------------------------------------------------------------------------------------------------
# 4. position-embedding overhead
# --------------------------------------------------------------------------------------------------------------------
def bench_overhead(T: int, rounds: int) -> dict:
    return position_embedding_overhead(build_model, T, MODEL_CONFIG["vocab_size"], rounds, rotary_inputs,
                                       TARGET_ROPE_OVERHEAD, SEED, use_cache=True)


# --------------------------------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------------------------------
def print_table(results: dict) -> None:
    cfg = results["model_config"]
    line = print_header(
        results, "GLA CPU benchmark",
        f"model: hidden {cfg['hidden_size']}, layers {cfg['num_hidden_layers']}, heads {cfg['num_heads']}, "
        f"vocab {cfg['vocab_size']}, short conv {cfg['use_short_conv']}, key/value head dims "
        f"{cfg['head_k_dim']}/{cfg['head_v_dim']}, {cfg['num_parameters']:,} params, fp32, batch 1")

    log("1. Prefill throughput (selective_rope, use_cache=True)")
    print_prefill_rows(results["prefill"]["rows"])

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

    print_decode(results["decode"], 3)
    print_overhead(results["overhead"], 4)
    print_selective_vs_nope(results["compare"], 5)
    print_footer(results, line)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(parser, DEFAULT_OUTPUT)
    parser.add_argument("--profile", action="store_true",
                        help="always profile the Selective RoPE overhead (done anyway when its target is missed)")
    args = parser.parse_args(argv)
    if args.compare_only and args.output == DEFAULT_OUTPUT:
        args.output = COMPARE_OUTPUT
    threads = configure(args, SEED)

    if args.quick:
        plan = {"prefill_lengths": [256, 1024], "prefill_repeats": 3, "op_lengths": [512, 2048], "op_target": 2048,
                "op_rounds": 3, "decode_contexts": [256, 4096], "decode_steps": 8, "decode_steps_per_round": 4,
                "decode_warmup": 2, "overhead_len": 1024, "overhead_rounds": 3}
    else:
        plan = {"prefill_lengths": [256, 1024, 4096], "prefill_repeats": 7, "op_lengths": [512, 2048],
                "op_target": 2048, "op_rounds": 9, "decode_contexts": [256, 4096], "decode_steps": 32,
                "decode_steps_per_round": 8, "decode_warmup": 4, "overhead_len": 2048, "overhead_rounds": 15}

    plan.update(COMPARE_PLANS["quick" if args.quick else "full"])  # section 5 (or --compare-only)
    start_all = time.perf_counter()
    results = start_results("bench_gla_cpu", args, threads, SOURCES, plan)
    probe = build_model("selective_rope")
    results["model_config"] = {**MODEL_CONFIG, "position_embedding": "selective_rope (sections 1-3); all three in 4",
                               "head_k_dim": probe.config.head_k_dim, "head_v_dim": probe.config.head_v_dim,
                               "expand_k": probe.config.expand_k, "expand_v": probe.config.expand_v,
                               "conv_size": probe.config.conv_size, "num_parameters": num_parameters(probe),
                               "dtype": "float32", "seed": SEED, "full_config": probe.config.to_diff_dict()}
    del probe
    cfg = results["model_config"]
    cfg["summary"] = (f"hidden {cfg['hidden_size']}, layers {cfg['num_hidden_layers']}, heads {cfg['num_heads']}, "
                      f"vocab {cfg['vocab_size']}, {cfg['num_parameters']:,} params, fp32, batch 1")
    if args.compare_only:
        return run_compare_only(results, args, plan, build_model, MODEL_CONFIG["vocab_size"], start_all)

    log(f"[bench_gla_cpu] mode={results['mode']} threads={torch.get_num_threads()} "
        f"load avg={results['device']['load_average_start']}")
    sections = [
        ("prefill", "1. prefill throughput",
         lambda: bench_prefill(plan["prefill_lengths"], plan["prefill_repeats"])),
        ("gla_op", "2. chunk_gla vs naive_recurrent_gla",
         lambda: bench_gla_op(plan["op_lengths"], plan["op_target"], plan["op_rounds"])),
        ("decode", "3. decode latency",
         lambda: bench_decode(plan["decode_contexts"], plan["decode_steps"], plan["decode_steps_per_round"],
                              plan["decode_warmup"])),
        ("overhead", "4. position-embedding overhead",
         lambda: bench_overhead(plan["overhead_len"], plan["overhead_rounds"])),
    ]
    sections.append(("compare", "5. Selective RoPE vs NoPE: decode and prefill, interleaved",
                     lambda: selective_vs_nope(build_model, MODEL_CONFIG["vocab_size"], plan)))
    contention = run_sections(results, sections)

    results["targets"] = {
        f"chunk_gla speed-up vs naive at T={plan['op_target']}": results["gla_op"]["speedup_target"],
        f"decode {results['decode']['ratio_name']}": results["decode"]["ratio_target"],
        f"selective_rope / nope prefill time at T={plan['overhead_len']}":
            results["overhead"]["selective_rope_over_nope"],
        f"rope / nope prefill time at T={plan['overhead_len']}": results["overhead"]["rope_over_nope"],
    }
    results["targets"].update(results["compare"]["targets"])
    results["all_targets_met"] = all(t["met"] for t in results["targets"].values())
    if args.profile or not results["overhead"]["selective_rope_over_nope"]["met"]:
        log("profiling the Selective RoPE overhead (torch.profiler)")
        results["overhead"]["profile"] = profile_overhead(build_model, plan["overhead_len"],
                                                          MODEL_CONFIG["vocab_size"], rotary_inputs, use_cache=True)
    finish(results, contention, start_all)
    print_table(results)
    write_results(args.output, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
