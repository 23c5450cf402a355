"""CPU benchmark of SelectiveRopeGLA and its pure-PyTorch GLA kernels.

Measures, on the CPU, in float32 and under ``torch.inference_mode``:

1. prefill throughput (tokens/s) of a small GLA language model at several sequence lengths;
2. the chunk-parallel GLA op (``chunk_gla``) against flash-linear-attention's per-token reference
   (``fla.ops.gla.naive.naive_recurrent_gla``), forward only;
3. cached decoding latency (ms/token) after a short and a long context: a recurrent model should not slow
   down with the context length;
4. the prefill overhead of Selective RoPE (and of fixed RoPE) over NoPE for the same model.

Every target is reported as ``{"value", "target", "met"}``. Timings are medians over repeats after a warm-up
(``time.perf_counter``). Whatever is compared (chunk vs naive, the two decode contexts, the three position
embeddings) is measured *interleaved*: the variants take turns inside each round, so a change of machine load
hits all of them alike.

Other processes on the machine: with ``torch.set_num_threads(cores)``, one other busy process makes every
multi-threaded op wait for a descheduled OpenMP thread, and timings inflate by 10-100x. The script therefore
watches ``/proc/stat``: it waits (within ``--max-wait`` seconds in all) for the machine to be quiet before each
section, and a round during which other processes kept more than half a core busy is discarded and run again (at
most ``--max-redo`` times per measurement). What it saw is recorded under ``contention`` in the JSON.

Usage::

    python benchmarks/bench_gla_cpu.py               # full run (about a minute on a quiet 2-core machine)
    python benchmarks/bench_gla_cpu.py --quick       # smoke run (a few seconds)
    python benchmarks/bench_gla_cpu.py --output benchmarks/results/gla_cpu.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from selective_rope import SelectiveRopeGLAConfig, SelectiveRopeGLAForCausalLM
from selective_rope.kernels.gla_torch import chunk_gla

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUTPUT = REPO_ROOT / "benchmarks" / "results" / "gla_cpu.json"

SEED = 0
MODEL_CONFIG = dict(
    hidden_size=256,
    num_hidden_layers=4,
    num_heads=4,
    vocab_size=1024,
    use_short_conv=True,
)
GLA_OP_SHAPE = dict(B=1, H=4, K=64, V=64)

TARGET_CHUNK_SPEEDUP = 5.0  # chunk_gla at least 5x faster than the per-token reference at T=2048
TARGET_DECODE_RATIO = 1.2  # ms/token at context 4096 at most 1.2x that at context 256
TARGET_ROPE_OVERHEAD = 1.15  # (Selective) RoPE prefill at most 1.15x NoPE prefill

BUSY_THRESHOLD = 0.5  # cores kept busy by other processes above which a round counts as disturbed


def log(message: str = "") -> None:
    print(message, flush=True)


# --------------------------------------------------------------------------------------------------------------------
# machine information and load
# --------------------------------------------------------------------------------------------------------------------
def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def cpu_model_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def device_info(threads: int) -> dict:
    return {
        "processor": platform.processor(),
        "cpu_model": cpu_model_name(),
        "machine": platform.machine(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch_version": torch.__version__,
        "torch_num_threads": torch.get_num_threads(),
        "torch_num_threads_requested": threads,
        "torch_num_interop_threads": torch.get_num_interop_threads(),
        "cpu_count": os.cpu_count(),
        "cpu_count_usable": usable_cores(),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "load_average_start": load_average(),
    }


def source_provenance() -> dict:
    """git commit, and hashes of the source files the numbers depend on (they may hold uncommitted edits)."""
    import hashlib
    import subprocess

    files = ["kernels/gla_torch.py", "kernels/rotary_torch.py", "kernels/conv_torch.py", "modeling/gla.py",
             "modeling/rotary.py", "modeling/layers.py", "modeling/base.py"]
    info: dict = {"files_sha256_12": {}}
    for name in files:
        path = REPO_ROOT / name
        if path.exists():
            info["files_sha256_12"][name] = hashlib.sha256(path.read_bytes()).hexdigest()[:12]
    try:
        def git(*cmd: str) -> str:
            return subprocess.run(["git", *cmd], cwd=REPO_ROOT, capture_output=True, text=True,
                                  timeout=10).stdout.rstrip("\n")

        info["git_commit"] = git("rev-parse", "HEAD").strip()
        info["uncommitted_changes"] = [line[3:] for line in git("status", "--porcelain", "--", *files).splitlines()]
    except (OSError, subprocess.SubprocessError):
        pass
    return info


class LoadProbe:
    """CPU time that *other* processes used since the probe started: ``/proc/stat`` busy time minus our own."""

    def __init__(self):
        self.start = self._sample()

    @staticmethod
    def _sample() -> tuple[float, float | None, float]:
        busy = None
        try:
            with open("/proc/stat") as f:
                fields = [int(x) for x in f.readline().split()[1:9]]
            busy = (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # minus idle and iowait
        except (OSError, ValueError, IndexError):
            pass
        own = os.times()
        return time.perf_counter(), busy, own.user + own.system

    def others_cores(self) -> float | None:
        """Average number of cores other processes kept busy (clock-tick resolution: coarse under ~50 ms)."""
        wall0, busy0, own0 = self.start
        wall1, busy1, own1 = self._sample()
        if busy0 is None or busy1 is None or wall1 - wall0 <= 0:
            return None
        return max(0.0, (busy1 - busy0) - (own1 - own0)) / (wall1 - wall0)


class Quiet:
    """Waits for a quiet machine (within a total budget) and counts what it had to wait for or redo."""

    def __init__(self, max_wait_s: float, max_redo: int):
        self.max_wait_s, self.max_redo = max_wait_s, max_redo
        self.waited_s = 0.0
        self.redone_rounds = 0
        self.disturbed_rounds_kept = 0

    def wait(self, window_s: float = 0.25, quiet_windows: int = 2) -> None:
        """Return once ``quiet_windows`` consecutive windows saw other processes below the threshold."""
        quiet = 0
        while quiet < quiet_windows and self.waited_s < self.max_wait_s:
            probe = LoadProbe()
            time.sleep(window_s)
            self.waited_s += window_s
            busy = probe.others_cores()
            quiet = quiet + 1 if busy is None or busy < BUSY_THRESHOLD else 0

    def summary(self) -> dict:
        return {"waited_s": round(self.waited_s, 2), "redone_rounds": self.redone_rounds,
                "disturbed_rounds_kept": self.disturbed_rounds_kept}


QUIET = Quiet(max_wait_s=0.0, max_redo=0)  # configured in main()


def timed_rounds(fns: dict[str, Callable[[], object]], rounds: int, calls: int = 1, warmup: int = 1,
                 min_round_s: float = 0.1) -> dict:
    """Time every function in ``fns`` ``calls`` times per round, the functions taking turns (the first one rotates).

    ``calls`` is raised so that a round lasts at least ``min_round_s`` (judged from the last warm-up), long enough for
    ``/proc/stat`` to tell whether another process ran meanwhile. A round during which other processes kept more than
    ``BUSY_THRESHOLD`` cores busy is thrown away and run again after waiting for a quiet machine (at most
    ``QUIET.max_redo`` times per measurement). Returns ``{name: summary}`` in seconds per call.
    """
    names = list(fns)
    round_estimate = None
    for _ in range(warmup):
        start = time.perf_counter()
        for name in names:
            fns[name]()
        round_estimate = time.perf_counter() - start
    if round_estimate:
        calls = max(calls, min(50, int(min_round_s / round_estimate) + 1))
    times = {name: [] for name in names}
    faults = {name: 0 for name in names}
    busy_per_round, redo_left, r = [], QUIET.max_redo, 0
    while r < rounds:
        shift = r % len(names)
        order = names[shift:] + names[:shift]
        probe = LoadProbe()
        this_round = {name: [] for name in names}
        round_faults = {}
        for name in order:
            faults_before = minor_faults()
            for _ in range(calls):
                start = time.perf_counter()
                fns[name]()
                this_round[name].append(time.perf_counter() - start)
            round_faults[name] = minor_faults() - faults_before
        busy = probe.others_cores()
        if busy is not None and busy > BUSY_THRESHOLD:
            if redo_left > 0:
                redo_left -= 1
                QUIET.redone_rounds += 1
                QUIET.wait()
                continue
            QUIET.disturbed_rounds_kept += 1
        busy_per_round.append(None if busy is None else round(busy, 2))
        for name in names:
            times[name].extend(this_round[name])
            faults[name] += round_faults[name]
        r += 1
    # minor page faults per call: fresh memory pages the allocator had to map (large temporaries freed to the OS
    # and mapped again on every call show up here)
    return {name: {**summarize(times[name]), "rounds": rounds, "calls_per_round": calls,
                   "minor_page_faults_per_call": round(faults[name] / max(1, len(times[name])), 1),
                   "others_cores_per_round": busy_per_round} for name in names}


def minor_faults() -> int:
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    except (ImportError, OSError):
        return 0


def summarize(times: list[float]) -> dict:
    return {
        "median_s": statistics.median(times),
        "min_s": min(times),
        "max_s": max(times),
        "repeats": len(times),
        "times_s": [round(t, 6) for t in times],
    }


def target(value: float, goal: float, higher_is_better: bool) -> dict:
    met = value >= goal if higher_is_better else value <= goal
    return {"value": round(value, 4), "target": goal, "comparison": ">=" if higher_is_better else "<=",
            "met": bool(met)}


# --------------------------------------------------------------------------------------------------------------------
# inputs
# --------------------------------------------------------------------------------------------------------------------
def build_model(position_embedding: str) -> SelectiveRopeGLAForCausalLM:
    torch.manual_seed(SEED)
    config = SelectiveRopeGLAConfig(position_embedding=position_embedding, **MODEL_CONFIG)
    return SelectiveRopeGLAForCausalLM(config).eval()


def random_ids(length: int, vocab_size: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (1, length), generator=generator)


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
    model = build_model("selective_rope")
    rows = []
    for T in lengths:
        ids = random_ids(T, MODEL_CONFIG["vocab_size"], seed=T)
        with torch.inference_mode():
            stats = timed_rounds({"prefill": lambda: model(ids, use_cache=True)}, rounds=repeats)["prefill"]
        tokens_per_s = T / stats["median_s"]
        rows.append({"seq_len": T, "tokens_per_s": round(tokens_per_s, 1), **stats})
        log(f"  prefill T={T:5d}: {stats['median_s'] * 1e3:9.1f} ms  ->  {tokens_per_s:9.0f} tokens/s")
    return {"position_embedding": "selective_rope", "batch_size": 1, "use_cache": True, "warmup": 1, "rows": rows}


# --------------------------------------------------------------------------------------------------------------------
# 2. chunk-parallel vs per-token GLA op
# --------------------------------------------------------------------------------------------------------------------
def bench_gla_op(lengths: list[int], target_len: int, rounds: int) -> dict:
    from fla.ops.gla.naive import naive_recurrent_gla  # the oracle; imported lazily (slow import)

    rows = []
    for T in lengths:
        q, k, v, gk = gla_inputs(T, seed=T)
        with torch.inference_mode():
            o_chunk, _ = chunk_gla(q, k, v, gk)
            o_naive, _ = naive_recurrent_gla(q, k, v, gk)
            max_abs_err = (o_chunk - o_naive).abs().max().item()
            stats = timed_rounds({"chunk_gla": lambda: chunk_gla(q, k, v, gk),
                                  "naive_recurrent_gla": lambda: naive_recurrent_gla(q, k, v, gk)},
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
    model = build_model("selective_rope")
    vocab = MODEL_CONFIG["vocab_size"]
    caches, next_ids, prefill_s = {}, {}, {}
    with torch.inference_mode():
        for ctx in contexts:
            ids = random_ids(ctx, vocab, seed=1000 + ctx)
            start = time.perf_counter()
            out = model(ids, use_cache=True)
            prefill_s[ctx] = time.perf_counter() - start
            caches[ctx] = out.past_key_values
            next_ids[ctx] = out.logits[:, -1:].argmax(-1)

        def step(ctx: int) -> None:
            out = model(next_ids[ctx], past_key_values=caches[ctx], use_cache=True)
            caches[ctx] = out.past_key_values
            next_ids[ctx] = out.logits[:, -1:].argmax(-1)  # greedy: each step depends on the previous one

        for _ in range(warmup_steps):
            for ctx in contexts:
                step(ctx)
        stats = timed_rounds({ctx: (lambda c=ctx: step(c)) for ctx in contexts},
                             rounds=-(-steps // steps_per_round), calls=steps_per_round, warmup=0)

    rows = []
    for ctx in contexts:
        s = stats[ctx]
        ms = s["median_s"] * 1e3
        rows.append({"context": ctx, "ms_per_token": round(ms, 3), "prefill_s": round(prefill_s[ctx], 4),
                     "cache_seq_length_at_end": caches[ctx].get_seq_length(), **s})
        log(f"  decode context={ctx:5d}: {ms:7.2f} ms/token (median of {s['repeats']}; min {s['min_s'] * 1e3:.2f})")
    ratio = rows[-1]["median_s"] / rows[0]["median_s"]
    return {"position_embedding": "selective_rope", "steps": rows[0]["repeats"], "steps_per_round": steps_per_round,
            "warmup_steps": warmup_steps, "sampling": "greedy", "rows": rows,
            "ratio_name": f"ms/token at {contexts[-1]} / at {contexts[0]}",
            "ratio_target": target(ratio, TARGET_DECODE_RATIO, higher_is_better=False)}


# --------------------------------------------------------------------------------------------------------------------
# 4. position-embedding overhead
# --------------------------------------------------------------------------------------------------------------------
def bench_overhead(T: int, rounds: int) -> dict:
    variants = ["nope", "rope", "selective_rope"]
    models = {name: build_model(name) for name in variants}  # same seed for all three
    params = {name: sum(p.numel() for p in m.parameters()) for name, m in models.items()}
    ids = random_ids(T, MODEL_CONFIG["vocab_size"], seed=2024)
    x, q, k = rotary_inputs(T)
    with torch.inference_mode():
        stats = timed_rounds({name: (lambda m=models[name]: m(ids, use_cache=True)) for name in variants},
                             rounds=rounds)
        # the rotary module alone, one layer: what (Selective) RoPE adds to a NoPE layer
        rotary = {name: models[name].model.layers[0].attn.rotary for name in ("rope", "selective_rope")}
        alone = timed_rounds({name: (lambda r=rotary[name]: r(x, q, k)) for name in rotary}, rounds=rounds, calls=3,
                             warmup=2)

    base = stats["nope"]["median_s"]
    layers = MODEL_CONFIG["num_hidden_layers"]
    result = {"seq_len": T, "batch_size": 1, "use_cache": True, "rounds": rounds, "interleaved": True, "seed": SEED,
              "num_parameters": params, "timings": stats, "rotary_module_alone": alone}
    for name in ("rope", "selective_rope"):
        ratio = stats[name]["median_s"] / base
        paired = statistics.median(a / b for a, b in zip(stats[name]["times_s"], stats["nope"]["times_s"]))
        result[f"{name}_over_nope"] = target(ratio, TARGET_ROPE_OVERHEAD, higher_is_better=False)
        result[f"{name}_over_nope"]["paired_round_ratio_median"] = round(paired, 4)
        per_layer = alone[name]["median_s"]
        result[f"{name}_rotary_cost"] = {
            "ms_per_layer": round(per_layer * 1e3, 3),
            "ms_all_layers": round(per_layer * layers * 1e3, 3),
            "fraction_of_nope_prefill": round(per_layer * layers / base, 4),
        }
    for name in variants:
        extra = ""
        if name != "nope":
            extra = (f"  ({result[f'{name}_over_nope']['value']:.3f}x NoPE; rotary module alone "
                     f"{result[f'{name}_rotary_cost']['ms_all_layers']:.1f} ms over {layers} layers)")
        log(f"  prefill T={T} {name:15s}: {stats[name]['median_s'] * 1e3:8.1f} ms{extra}")
    return result


def profile_overhead(T: int, calls: int = 3, top: int = 12) -> dict:
    """Where Selective RoPE's extra prefill time goes: torch.profiler self-CPU time per op, selective_rope minus
    nope (same seed, same input), and the top ops of the rotary module alone."""
    from torch.profiler import ProfilerActivity, profile

    ids = random_ids(T, MODEL_CONFIG["vocab_size"], seed=2024)
    per_variant = {}
    QUIET.wait()
    with torch.inference_mode():
        for name in ("nope", "selective_rope"):
            model = build_model(name)
            model(ids, use_cache=True)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(calls):
                    model(ids, use_cache=True)
            per_variant[name] = {e.key: (e.self_cpu_time_total / calls / 1e3, e.count // calls)
                                 for e in prof.key_averages()}
        rotary = build_model("selective_rope").model.layers[0].attn.rotary
        x, q, k = rotary_inputs(T)
        rotary(x, q, k)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(calls):
                rotary(x, q, k)
        rotary_ops = sorted(((e.key, e.self_cpu_time_total / calls / 1e3, e.count // calls)
                             for e in prof.key_averages()), key=lambda r: -r[1])[:top]

    sel, nope = per_variant["selective_rope"], per_variant["nope"]
    diff = sorted(((op, sel.get(op, (0, 0))[0] - nope.get(op, (0, 0))[0],
                    sel.get(op, (0, 0))[1] - nope.get(op, (0, 0))[1]) for op in set(sel) | set(nope)),
                  key=lambda r: -r[1])[:top]
    total = {name: sum(ms for ms, _ in ops.values()) for name, ops in per_variant.items()}
    log(f"  profiled self-CPU per forward: nope {total['nope']:.1f} ms, "
        f"selective_rope {total['selective_rope']:.1f} ms")
    log("  extra self-CPU ms per forward (selective_rope - nope), top ops:")
    for op, ms, extra_calls in diff:
        log(f"    {op:32s} {ms:+8.2f} ms  ({extra_calls:+d} calls)")
    log("  rotary module alone (one layer), top self-CPU ops:")
    for op, ms, count in rotary_ops:
        log(f"    {op:32s} {ms:8.3f} ms  ({count} calls)")
    return {"seq_len": T, "calls": calls,
            "self_cpu_ms_per_forward": {name: round(v, 2) for name, v in total.items()},
            "extra_self_cpu_ms_by_op": [{"op": op, "ms": round(ms, 3), "extra_calls": c} for op, ms, c in diff],
            "rotary_module_one_layer_top_ops": [{"op": op, "ms": round(ms, 3), "calls": c}
                                                for op, ms, c in rotary_ops]}


# --------------------------------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------------------------------
def print_table(results: dict) -> None:
    info = results["device"]
    line = "=" * 104
    log()
    log(line)
    log(f"GLA CPU benchmark ({results['mode']})  |  {info['cpu_model'] or info['processor'] or info['machine']}")
    log(f"torch {info['torch_version']}  |  threads {info['torch_num_threads']} / cpu_count {info['cpu_count']}  |  "
        f"{info['date']}  |  load avg start {info['load_average_start']} end {info['load_average_end']}")
    cfg = results["model_config"]
    log(f"model: hidden {cfg['hidden_size']}, layers {cfg['num_hidden_layers']}, heads {cfg['num_heads']}, "
        f"vocab {cfg['vocab_size']}, short conv {cfg['use_short_conv']}, key/value head dims "
        f"{cfg['head_k_dim']}/{cfg['head_v_dim']}, {cfg['num_parameters']:,} params, fp32, batch 1")
    log(line)

    log("1. Prefill throughput (selective_rope, use_cache=True)")
    log(f"   {'T':>6} | {'median ms':>10} | {'min ms':>8} | {'tokens/s':>10}")
    for row in results["prefill"]["rows"]:
        log(f"   {row['seq_len']:>6} | {row['median_s'] * 1e3:>10.1f} | {row['min_s'] * 1e3:>8.1f} | "
            f"{row['tokens_per_s']:>10.0f}")

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

    dec = results["decode"]
    log(f"3. Decode (selective_rope, median of {dec['steps']} single-token steps per context, contexts interleaved)")
    log(f"   {'context':>7} | {'ms/token':>9} | {'min ms':>8} | {'prefill s':>9}")
    for row in dec["rows"]:
        log(f"   {row['context']:>7} | {row['ms_per_token']:>9.2f} | {row['min_s'] * 1e3:>8.2f} | "
            f"{row['prefill_s']:>9.3f}")

    ov = results["overhead"]
    log(f"4. Position-embedding prefill overhead, T={ov['seq_len']} (same seed, {ov['rounds']} interleaved rounds)")
    log(f"   {'variant':>15} | {'median ms':>10} | {'x NoPE':>7} | {'paired':>7} | {'rotary module, all layers':>25}")
    for name in ("nope", "rope", "selective_rope"):
        t = ov["timings"][name]["median_s"] * 1e3
        if name == "nope":
            log(f"   {name:>15} | {t:>10.1f} | {1.0:>7.3f} | {1.0:>7.3f} | {'-':>25}")
        else:
            r = ov[f"{name}_over_nope"]
            cost = ov[f"{name}_rotary_cost"]
            log(f"   {name:>15} | {t:>10.1f} | {r['value']:>7.3f} | {r['paired_round_ratio_median']:>7.3f} | "
                f"{cost['ms_all_layers']:>8.1f} ms ({100 * cost['fraction_of_nope_prefill']:>4.1f}% of NoPE)")

    log(line)
    log("Targets")
    for key, goal in results["targets"].items():
        status = "MET" if goal["met"] else "MISSED"
        log(f"   {key:50s} {goal['value']:>8.3f}  (target {goal['comparison']} {goal['target']})  {status}")
    busy = ", ".join(f"{key} {c.get('others_cores', float('nan')):.2f}" for key, c in results["contention"].items()
                     if isinstance(c, dict) and "wall_s" in c)
    log(f"cores kept busy by other processes, per section (including any waits): {busy}")
    log(f"waited for a quiet machine {results['contention']['quiet']['waited_s']:.1f} s, redid "
        f"{results['contention']['quiet']['redone_rounds']} disturbed rounds, kept "
        f"{results['contention']['quiet']['disturbed_rounds_kept']} disturbed rounds")
    log(f"total wall time {results['total_wall_s']:.1f} s")
    log(line)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="short smoke run (small sizes, few repeats)")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help=f"JSON path (default {DEFAULT_OUTPUT})")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (default: the number of usable CPU cores)")
    parser.add_argument("--profile", action="store_true",
                        help="always profile the Selective RoPE overhead (done anyway when its target is missed)")
    parser.add_argument("--max-wait", type=float, default=None,
                        help="seconds in all to wait for other processes to go quiet (default 180, quick 10)")
    parser.add_argument("--max-redo", type=int, default=None,
                        help="disturbed rounds run again per measurement (default 8, quick 1)")
    args = parser.parse_args(argv)

    cores = usable_cores()
    threads = args.threads or cores
    torch.set_num_threads(threads)
    torch.manual_seed(SEED)
    QUIET.max_wait_s = args.max_wait if args.max_wait is not None else (10.0 if args.quick else 180.0)
    QUIET.max_redo = args.max_redo if args.max_redo is not None else (1 if args.quick else 8)

    if args.quick:
        plan = dict(prefill_lengths=[256, 1024], prefill_repeats=3, op_lengths=[512, 2048], op_target=2048,
                    op_rounds=3, decode_contexts=[256, 4096], decode_steps=8, decode_steps_per_round=4,
                    decode_warmup=2, overhead_len=1024, overhead_rounds=3)
    else:
        plan = dict(prefill_lengths=[256, 1024, 4096], prefill_repeats=7, op_lengths=[512, 2048], op_target=2048,
                    op_rounds=9, decode_contexts=[256, 4096], decode_steps=32, decode_steps_per_round=8,
                    decode_warmup=4, overhead_len=2048, overhead_rounds=15)

    start_all = time.perf_counter()
    results: dict = {"benchmark": "bench_gla_cpu", "mode": "quick" if args.quick else "full",
                     "device": device_info(threads), "source": source_provenance(), "plan": plan}
    probe = build_model("selective_rope")
    results["model_config"] = {**MODEL_CONFIG, "position_embedding": "selective_rope (sections 1-3); all three in 4",
                               "head_k_dim": probe.config.head_k_dim, "head_v_dim": probe.config.head_v_dim,
                               "expand_k": probe.config.expand_k, "expand_v": probe.config.expand_v,
                               "conv_size": probe.config.conv_size,
                               "num_parameters": sum(p.numel() for p in probe.parameters()),
                               "dtype": "float32", "seed": SEED, "full_config": probe.config.to_diff_dict()}
    del probe

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
    contention: dict = {}
    for key, title, run in sections:
        log(title)
        QUIET.wait()
        probe = LoadProbe()
        start = time.perf_counter()
        results[key] = run()
        busy = probe.others_cores()
        contention[key] = {"wall_s": round(time.perf_counter() - start, 2),
                           "others_cores": None if busy is None else round(busy, 2)}

    results["targets"] = {
        f"chunk_gla speed-up vs naive at T={plan['op_target']}": results["gla_op"]["speedup_target"],
        f"decode {results['decode']['ratio_name']}": results["decode"]["ratio_target"],
        f"selective_rope / nope prefill time at T={plan['overhead_len']}":
            results["overhead"]["selective_rope_over_nope"],
        f"rope / nope prefill time at T={plan['overhead_len']}": results["overhead"]["rope_over_nope"],
    }
    results["all_targets_met"] = all(t["met"] for t in results["targets"].values())
    if args.profile or not results["overhead"]["selective_rope_over_nope"]["met"]:
        log("profiling the Selective RoPE overhead (torch.profiler)")
        results["overhead"]["profile"] = profile_overhead(plan["overhead_len"])
    contention["quiet"] = QUIET.summary()
    results["contention"] = contention
    results["device"]["load_average_end"] = load_average()
    results["total_wall_s"] = round(time.perf_counter() - start_all, 2)

    busy = {key: c["others_cores"] for key, c in contention.items() if "others_cores" in c}
    if QUIET.disturbed_rounds_kept:
        results["warning"] = (f"{QUIET.disturbed_rounds_kept} timed rounds ran while other processes kept more than "
                              f"{BUSY_THRESHOLD} cores busy and were kept (no redo left; cores busy per section, "
                              f"waits included: {busy}): absolute timings may be inflated; the interleaved ratios "
                              "are less affected")

    print_table(results)
    if "warning" in results:
        log(f"WARNING: {results['warning']}")

    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2, default=str) + "\n")
    log(f"saved {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
