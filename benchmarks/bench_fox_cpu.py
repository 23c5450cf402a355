"""CPU benchmark of SelectiveRopeFoX (the Forgetting Transformer: softmax attention with a forget gate).

Measures, on the CPU, in float32 and under ``torch.inference_mode``:

1. prefill time and peak memory of a small FoX language model at several sequence lengths. Every length runs in
   a fresh Python process: it builds the model, runs a short warm-up forward, then measures the resident memory
   (``VmRSS``) as the baseline, resets the process's peak (``echo 5 > /proc/self/clear_refs`` resets ``VmHWM``) and
   runs the forward; the peak resident memory above the baseline (``VmHWM - VmRSS before``) is what the forward
   needed. A full ``T x T`` float32 score matrix for all heads (what eager attention materialises per layer) is
   reported next to it: the blockwise attention never builds one, so the peak grows about linearly in ``T``
   (logits, activations, and with ``use_cache=True`` the cached keys and values), not quadratically. Prefill time
   is measured in the same process after the memory runs; a second process per length measures the memory of a
   ``use_cache=True`` forward.
2. cached decoding latency (ms/token) after a short and a long context. Softmax attention reads every cached key
   at each step, so decoding slows down with the context; the numbers are reported, with no flatness target.
3. the prefill overhead of Selective RoPE (and of fixed RoPE) over NoPE for the same model (informal target
   <= 1.15x).
4. against the peer, transformers' Llama: a random Llama of the same shape (made here with transformers, no
   download) and three conversions of it by ``selective_rope.conversion.convert``: the plain port (RoPE, no forget
   gate: Llama's math in our classes), FoX with RoPE and a forget gate, and Selective RoPE FoX (the converter's
   default). Cached decoding (ms/token after 256 and 4096 tokens) and prefill (2048 and 8192 tokens), all four
   models interleaved round by round; ratios to Llama pair the calls of the same round (median and quartiles, wall
   time; process CPU time too). Targets: Selective RoPE FoX decode <= 1.15x and prefill at 8k <= 1.10x Llama, the
   plain port <= 1.05x. ``--compare-only`` runs this section alone.


Timing and load watching are shared with the other benchmarks (the harness ``benchmarks/harness`` runs this
script's spec, ``SPEC``): medians over
interleaved rounds after a warm-up, the script (and every child process) waits for a quiet machine and re-runs
rounds that other processes disturbed; what it saw is recorded under ``contention`` in the JSON.

Usage::

    python benchmarks/bench_fox_cpu.py               # full run (a few minutes on a quiet 2-core machine)
    python benchmarks/bench_fox_cpu.py --quick       # smoke run
    python benchmarks/bench_fox_cpu.py --output benchmarks/results/fox_cpu.json
    python benchmarks/bench_fox_cpu.py --compare-only   # section 4 -> benchmarks/results/fox_vs_llama_cpu.json
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from selective_rope import SelectiveRopeFoXForCausalLM
from selective_rope.configuration import SelectiveRopeFoXConfig
from selective_rope.modeling import returned_cache

from harness.machine import Quiet, source_provenance
from harness.measure import decode_comparison, num_parameters, prefill_comparison, random_ids
from harness.report import log, print_comparison
from harness.runner import Comparison, FamilyBenchmark, Run, run_benchmark, script_paths
from harness.timing import target, timed_rounds

# the repository root; benchmarks/results/fox_cpu.json, and fox_vs_llama_cpu.json for --compare-only
PATHS = script_paths(__file__, "fox", comparison="vs_llama")
SOURCES = ["kernels/forgetting_attention_torch.py", "modeling/fox.py", "configuration/fox.py",
           "benchmarks/bench_fox_cpu.py"]

SEED = 0
MODEL_CONFIG = {
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "intermediate_size": 768,  # the MLP width of the GLA / Gated DeltaNet benchmark models
    "vocab_size": 1024,
    "use_forget_gate": True,
}

# The peer: transformers' Llama of the benchmark model's shape (RoPE base of Llama 3).
LLAMA_CONFIG = {key: MODEL_CONFIG[key] for key in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                                  "num_key_value_heads", "head_dim", "intermediate_size",
                                                  "vocab_size")}
LLAMA_ROPE = {"rope_type": "default", "rope_theta": 500000.0}
PEER_BASE = "llama"
TARGET_PEER = {"fox_selective": {"decode": 1.15, "prefill": 1.10}, "port": {"decode": 1.05, "prefill": 1.05}}
TARGET_MEMORY_EXPONENT = 1.5  # peak memory ~ T^e between the two longest lengths: 1 is linear, 2 quadratic
TARGET_ROPE_OVERHEAD = 1.15  # informal: (Selective) RoPE prefill at most 1.15x NoPE prefill
WARMUP_LEN = 128  # the short forward run before the memory baseline (lazy initialisation of kernels, buffers)
RESULT_MARKER = "BENCH_FOX_WORKER_RESULT "
SOURCE_HASHES_AT_START: dict[str, str] = {}  # set by main()


# --------------------------------------------------------------------------------------------------------------------
# inputs
# --------------------------------------------------------------------------------------------------------------------
def rotary_inputs(T: int):
    cfg = SelectiveRopeFoXConfig(**MODEL_CONFIG)
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(1, T, cfg.hidden_size, generator=generator)
    q = torch.randn(1, T, cfg.num_attention_heads, cfg.head_dim, generator=generator)
    k = torch.randn(1, T, cfg.num_key_value_heads, cfg.head_dim, generator=generator)
    return x, q, k


# --------------------------------------------------------------------------------------------------------------------
# process memory
# --------------------------------------------------------------------------------------------------------------------
def proc_status_kib() -> dict[str, int]:
    """VmRSS (resident now) and VmHWM (peak resident) of this process, in KiB, from /proc/self/status."""
    with open("/proc/self/status") as f:
        text = f.read()
    return {key: int(re.search(rf"^{key}:\s+(\d+)\s+kB", text, re.MULTILINE).group(1)) for key in ("VmRSS", "VmHWM")}


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current VmRSS (Linux >= 4.0); False if the kernel refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    status = proc_status_kib()
    return status["VmHWM"] <= status["VmRSS"] + 64


def ru_maxrss_kib() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux


def cache_bytes(cache) -> int:
    total = 0
    for layer in getattr(cache, "layers", []):
        total += sum(t.numel() * t.element_size() for t in getattr(layer, "states", {}).values())
    return total


def measured_forward(model, ids: torch.Tensor, use_cache: bool) -> dict:
    """One forward with its peak resident memory above the resident memory just before it."""
    gc.collect()
    before = proc_status_kib()["VmRSS"]
    reset_ok = reset_peak_rss()
    ru_before = ru_maxrss_kib()
    start = time.perf_counter()
    out = model(ids, use_cache=use_cache)
    seconds = time.perf_counter() - start
    status = proc_status_kib()
    record = {"seconds": round(seconds, 4), "rss_before_mib": round(before / 1024, 1),
              "rss_after_mib": round(status["VmRSS"] / 1024, 1),
              "logits_mib": round(out.logits.numel() * out.logits.element_size() / 2**20, 1),
              "cache_mib": round(cache_bytes(returned_cache(out)) / 2**20, 1) if use_cache else 0.0}
    if reset_ok:
        record.update(method="VmHWM after clear_refs", peak_above_baseline_mib=round((status["VmHWM"] - before) / 1024,
                                                                                     1))
    else:  # the process-lifetime peak: valid as long as nothing before this forward peaked higher
        peak = ru_maxrss_kib()
        record.update(method="ru_maxrss (clear_refs unavailable)",
                      peak_above_baseline_mib=round((peak - before) / 1024, 1),
                      earlier_peak_may_hide_this_one=ru_before >= peak)
    del out
    gc.collect()
    return record


def prefill_worker(spec: dict, quiet: Quiet) -> dict:
    """Run in a fresh process: memory of ``calls`` forwards at ``seq_len`` (the first is the figure reported), then
    ``repeats`` timed rounds (none when 0)."""
    T, use_cache = spec["seq_len"], spec["use_cache"]
    model = SPEC.build_model("selective_rope")
    ids = random_ids(T, MODEL_CONFIG["vocab_size"], seed=T)
    result: dict = {"seq_len": T, "use_cache": use_cache, "pid": os.getpid()}
    with torch.inference_mode():
        model(random_ids(WARMUP_LEN, MODEL_CONFIG["vocab_size"], seed=1), use_cache=use_cache)
        result["memory_calls"] = [measured_forward(model, ids, use_cache) for _ in range(spec["calls"])]
        if spec["repeats"]:
            result["timing"] = timed_rounds({"prefill": lambda: model(ids, use_cache=use_cache)},
                                            rounds=spec["repeats"], quiet=quiet, warmup=0)["prefill"]
    result["ru_maxrss_mib"] = round(ru_maxrss_kib() / 1024, 1)
    result["quiet"] = quiet.summary()
    result["files_sha256_12"] = source_provenance(PATHS.root, SOURCES)["files_sha256_12"]  # what this process imported
    return result


def run_worker(spec: dict, threads: int, quiet: Quiet) -> dict:
    """``prefill_worker(spec)`` in a fresh Python process (this script with ``--worker``)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec), "--threads", str(threads),
           "--max-wait", str(quiet.remaining_s()), "--max-redo", str(quiet.max_redo)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_MARKER)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"worker {spec} failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n"
                           f"{proc.stderr[-4000:]}")
    result = json.loads(lines[-1][len(RESULT_MARKER):])
    quiet.absorb(result.pop("quiet"))
    # the worker imports the sources afresh: flag any that changed since the run started
    changed = sorted(name for name, digest in result.pop("files_sha256_12").items()
                     if SOURCE_HASHES_AT_START.get(name) != digest)
    if changed:
        result["sources_changed_since_start"] = changed
        log(f"  WARNING: sources changed since the run started: {', '.join(changed)}")
    return result


# --------------------------------------------------------------------------------------------------------------------
# 1. prefill time and peak memory
# --------------------------------------------------------------------------------------------------------------------
def bench_prefill_memory(lengths: list[int], repeats: dict[int, int], threads: int, memory_calls: int,
                         quiet: Quiet) -> dict:
    cfg = SelectiveRopeFoXConfig(**MODEL_CONFIG)
    heads = cfg.num_attention_heads
    rows = []
    for T in lengths:
        no_cache = run_worker({"seq_len": T, "use_cache": False, "calls": memory_calls, "repeats": repeats[T]},
                              threads, quiet)
        with_cache = run_worker({"seq_len": T, "use_cache": True, "calls": 1, "repeats": 0}, threads, quiet)
        timing = no_cache.pop("timing")
        first, cached = no_cache["memory_calls"][0], with_cache["memory_calls"][0]
        scores_mib = heads * T * T * 4 / 2**20  # one layer's (1, Hq, T, T) float32 scores
        row = {"seq_len": T, "tokens_per_s": round(T / timing["median_s"], 1), **timing,
               "peak_above_baseline_mib": first["peak_above_baseline_mib"],
               "peak_above_baseline_mib_use_cache": cached["peak_above_baseline_mib"],
               "full_score_matrix_all_heads_mib": round(scores_mib, 1),
               "peak_over_full_score_matrix": round(first["peak_above_baseline_mib"] / scores_mib, 4),
               "logits_mib": first["logits_mib"], "cache_mib": cached["cache_mib"],
               "use_cache_false": no_cache, "use_cache_true": with_cache}
        rows.append(row)
        log(f"  prefill T={T:5d}: {timing['median_s'] * 1e3:9.1f} ms ({row['tokens_per_s']:7.0f} tokens/s) | peak "
            f"+{row['peak_above_baseline_mib']:7.1f} MiB (use_cache=True "
            f"+{row['peak_above_baseline_mib_use_cache']:.1f} MiB) | full T x T scores, all heads: "
            f"{scores_mib:9.1f} MiB")
    a, b = rows[-2], rows[-1]
    exponent = math.log(b["peak_above_baseline_mib"] / a["peak_above_baseline_mib"]) / math.log(b["seq_len"] /
                                                                                                  a["seq_len"])
    exponent_cache = math.log(b["peak_above_baseline_mib_use_cache"] / a["peak_above_baseline_mib_use_cache"]) / \
        math.log(b["seq_len"] / a["seq_len"])
    log(f"  peak memory growth between T={a['seq_len']} and T={b['seq_len']}: ~T^{exponent:.2f} "
        f"(use_cache=True: ~T^{exponent_cache:.2f}); a full score matrix grows as T^2")
    return {"position_embedding": "selective_rope", "batch_size": 1, "timed_with_use_cache": False,
            "fresh_process_per_length": True, "warmup_len_before_baseline": WARMUP_LEN,
            "memory_calls_per_process": memory_calls,
            "memory_figure": "first forward of a fresh process: VmHWM - VmRSS just before (reset with clear_refs)",
            "full_score_matrix": "num_attention_heads * T * T * 4 bytes (float32, batch 1, one layer)",
            "rows": rows, "growth_exponent_use_cache_false": round(exponent, 3),
            "growth_exponent_use_cache_true": round(exponent_cache, 3),
            "memory_target": target(exponent, TARGET_MEMORY_EXPONENT, higher_is_better=False)}


# --------------------------------------------------------------------------------------------------------------------
# 4. against transformers' Llama
# --------------------------------------------------------------------------------------------------------------------
def build_peers(directory: Path) -> tuple[dict, dict]:
    """A random transformers Llama saved in ``directory`` and its conversions, all loaded from disk in eval mode:
    ``{"llama", "port", "fox_rope", "fox_selective"}``, and what the converter reported for each."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from selective_rope.conversion import RetrofitOptions, convert

    torch.manual_seed(SEED)
    config = LlamaConfig(**LLAMA_CONFIG, rope_parameters=dict(LLAMA_ROPE), max_position_embeddings=32768)
    LlamaForCausalLM(config).save_pretrained(directory / "llama")
    variants = {"port": RetrofitOptions(selective=False, forget_gate=False),  # Llama's math in our classes
                "fox_rope": RetrofitOptions(selective=False),  # + the forget gate
                "fox_selective": RetrofitOptions()}  # + Selective RoPE: the converter's default
    models = {PEER_BASE: LlamaForCausalLM.from_pretrained(directory / "llama").eval()}
    reports = {PEER_BASE: {"attn_implementation": models[PEER_BASE].config._attn_implementation}}
    for name, options in variants.items():
        report = convert(directory / "llama", directory / name, options, license="apache-2.0", progress=False)
        reports[name] = {"options": vars(options), "max_logit_difference": report.max_logit_difference}
        models[name] = SelectiveRopeFoXForCausalLM.from_pretrained(directory / name).eval()
        reports[name]["position_embedding"] = models[name].config.position_embedding
        reports[name]["use_forget_gate"] = models[name].config.use_forget_gate
    return models, reports


def bench_peer(plan: dict, quiet: Quiet) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench_fox_llama_") as tmp:
        models, reports = build_peers(Path(tmp))
        params = {name: num_parameters(m) for name, m in models.items()}
        decode = decode_comparison(models, plan["peer_decode_contexts"], MODEL_CONFIG["vocab_size"],
                                   plan["peer_decode_rounds"], plan["peer_decode_steps_per_round"],
                                   plan["decode_warmup"], PEER_BASE, quiet)
        prefill = prefill_comparison(models, plan["peer_prefill_lengths"], MODEL_CONFIG["vocab_size"],
                                     plan["peer_prefill_rounds"], PEER_BASE, quiet)
    targets = {}
    for name, goals in TARGET_PEER.items():
        for row in decode["rows"]:
            ratio = row["models"][name]["ratio_to_" + PEER_BASE]["median"]
            targets[f"{name} / llama decode ms/token at context {row['context']}"] = target(ratio, goals["decode"],
                                                                                          higher_is_better=False)
        row = prefill["rows"][-1]
        ratio = row["models"][name]["ratio_to_" + PEER_BASE]["median"]
        targets[f"{name} / llama prefill at T={row['seq_len']}"] = target(ratio, goals["prefill"],
                                                                         higher_is_better=False)
    return {"models": reports, "num_parameters": params, "llama_config": {**LLAMA_CONFIG, "rope": LLAMA_ROPE},
            "decode": decode, "prefill": prefill, "targets": targets}


def print_peer(peer: dict, number: int) -> None:
    print_comparison(peer["decode"], f"{number}. Against transformers' Llama: cached decoding, ms/token (interleaved, "
                     "ratios paired by round)", "context")
    print_comparison(peer["prefill"], f"{number}. Against transformers' Llama: prefill, ms (interleaved)", "seq_len")


# --------------------------------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------------------------------
def print_sections(results: dict) -> None:
    pm = results["prefill_memory"]
    log("1. Prefill time and peak memory (selective_rope; a fresh process per length; peak resident memory above the "
        "baseline, use_cache=False, and use_cache=True in another process)")
    log(f"   {'T':>6} | {'median ms':>10} | {'min ms':>9} | {'tokens/s':>8} | {'peak MiB':>8} | {'with cache':>10} | "
        f"{'logits MiB':>10} | {'T x T scores MiB':>16}")
    for row in pm["rows"]:
        log(f"   {row['seq_len']:>6} | {row['median_s'] * 1e3:>10.1f} | {row['min_s'] * 1e3:>9.1f} | "
            f"{row['tokens_per_s']:>8.0f} | {row['peak_above_baseline_mib']:>8.1f} | "
            f"{row['peak_above_baseline_mib_use_cache']:>10.1f} | {row['logits_mib']:>10.1f} | "
            f"{row['full_score_matrix_all_heads_mib']:>16.1f}")
    log(f"   peak memory growth between the two longest lengths: ~T^{pm['growth_exponent_use_cache_false']:.2f} "
        f"(use_cache=True ~T^{pm['growth_exponent_use_cache_true']:.2f})")


# --------------------------------------------------------------------------------------------------------------------
# the spec
# --------------------------------------------------------------------------------------------------------------------
def sections(run: Run) -> list:
    plan = run.plan
    return [("prefill_memory", "1. prefill time and peak memory (a fresh process per length)",
             lambda: bench_prefill_memory(plan["prefill_lengths"], plan["prefill_repeats"], run.threads,
                                          plan["memory_calls"], run.quiet))]


def worker_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--worker", type=str, default=None, help=argparse.SUPPRESS)  # internal: one length


def run_as_worker(args: argparse.Namespace, threads: int, quiet: Quiet) -> int | None:
    """With ``--worker``: this process is one length's fresh process (``run_worker``), waiting within the budget the
    parent passed on."""
    if args.worker is None:
        return None
    print(RESULT_MARKER + json.dumps(prefill_worker(json.loads(args.worker), quiet)), flush=True)
    return 0


SPEC = FamilyBenchmark(
    name="bench_fox_cpu", title="FoX CPU benchmark", family="fox", description=__doc__.split("\n\n")[0],
    model_config=MODEL_CONFIG, seed=SEED, root=PATHS.root, sources=SOURCES, default_output=PATHS.default_output,
    plans={
        "quick": {"prefill_lengths": [512, 1024, 2048], "prefill_repeats": {512: 3, 1024: 3, 2048: 2},
                  "memory_calls": 1, "decode_contexts": [256, 4096], "decode_steps": 8, "decode_steps_per_round": 4,
                  "decode_warmup": 2, "overhead_len": 1024, "overhead_rounds": 3,
                  "peer_decode_contexts": [256, 1024], "peer_decode_rounds": 3, "peer_decode_steps_per_round": 2,
                  "peer_prefill_lengths": [512, 1024], "peer_prefill_rounds": 2},
        "full": {"prefill_lengths": [1024, 4096, 16384], "prefill_repeats": {1024: 7, 4096: 5, 16384: 3},
                 "memory_calls": 2, "decode_contexts": [256, 4096], "decode_steps": 32, "decode_steps_per_round": 8,
                 "decode_warmup": 4, "overhead_len": 2048, "overhead_rounds": 25,
                 "peer_decode_contexts": [256, 4096], "peer_decode_rounds": 40, "peer_decode_steps_per_round": 4,
                 "peer_prefill_lengths": [2048, 8192], "peer_prefill_rounds": 5},
    },
    sections=sections, print_sections=print_sections,
    targets=lambda results, plan: {
        f"peak memory growth exponent, T={plan['prefill_lengths'][-2]} -> {plan['prefill_lengths'][-1]}":
            results["prefill_memory"]["memory_target"]},
    rotary_inputs=rotary_inputs,
    model_line=lambda cfg: (
        f"model: hidden {cfg['hidden_size']}, layers {cfg['num_hidden_layers']}, heads {cfg['num_attention_heads']} "
        f"(kv {cfg['num_key_value_heads']}), head dim {cfg['head_dim']}, MLP {cfg['intermediate_size']}, vocab "
        f"{cfg['vocab_size']}, forget gate {cfg['use_forget_gate']}, {cfg['num_parameters']:,} params, fp32, batch 1"),
    decode_goal=None, overhead_goal=TARGET_ROPE_OVERHEAD, overhead_informal=True,
    add_arguments=worker_arguments, before_run=run_as_worker,
    on_start=lambda results: SOURCE_HASHES_AT_START.update(results["source"]["files_sha256_12"]),
    comparison=Comparison(
        key="peer", title="against transformers' Llama (random, converted as a plain port and as FoX)",
        run=lambda spec, run: bench_peer(run.plan, run.quiet), print_section=print_peer, output=PATHS.compare_output,
        header_title="FoX vs transformers' Llama, CPU",
        header_line=lambda cfg: (
            f"models: hidden {cfg['hidden_size']}, layers {cfg['num_hidden_layers']}, heads "
            f"{cfg['num_attention_heads']} (kv {cfg['num_key_value_heads']}), head dim {cfg['head_dim']}, MLP "
            f"{cfg['intermediate_size']}, vocab {cfg['vocab_size']}, fp32, batch 1"),
        only_position_embedding="see peer.models"),
)


if __name__ == "__main__":
    sys.exit(run_benchmark(SPEC))
