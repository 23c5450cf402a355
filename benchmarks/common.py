"""Timing infrastructure shared by the CPU benchmarks (``bench_*_cpu.py``).

What is here:

* machine and provenance information (``device_info``, ``source_provenance``);
* load probing and quiet waiting: with ``torch.set_num_threads(cores)``, one other busy process makes every
  multi-threaded op wait for a descheduled OpenMP thread, and timings inflate by 10-100x. ``LoadProbe`` reads
  ``/proc/stat`` to tell how many cores *other* processes kept busy; ``Quiet`` (one instance, ``QUIET``) waits,
  within a total budget, for a quiet machine and counts the rounds it had to redo or had to keep disturbed;
* ``timed_rounds``: interleaved timing of several functions (they take turns inside each round, so a change of
  machine load hits all of them alike), disturbed rounds thrown away and run again;
* ``summarize`` / ``target``: the JSON records of timings and targets;
* the measurements every family shares, on any ``*ForCausalLM`` of this package: prefill throughput
  (``prefill_rows``), cached decoding after several contexts (``decode_contexts``, ``decode_result``), the prefill
  overhead of RoPE and Selective RoPE over NoPE (``position_embedding_overhead``, ``profile_overhead``), and their
  printed tables;
* the command line, the section loop and the end of a run (``add_common_arguments``, ``configure``,
  ``run_sections``, ``finish``, ``print_header``, ``print_footer``, ``write_results``).

The scripts import this module as ``common``: run them as ``python benchmarks/bench_<family>_cpu.py`` (Python puts
the script's folder on ``sys.path``).

Every script writes one JSON file with the keys ``benchmark, mode, device, source, plan, model_config,
<sections>, targets, all_targets_met, contention, total_wall_s`` (and ``warning`` when disturbed rounds were
kept).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"

BUSY_THRESHOLD = 0.5  # cores kept busy by other processes above which a round counts as disturbed

# Source files every family's numbers depend on (the scripts add their family's kernel / modeling files).
SHARED_SOURCES = [
    "kernels/rotary_torch.py",
    "kernels/conv_torch.py",
    "modeling/rotary.py",
    "modeling/layers.py",
    "modeling/layout.py",
    "modeling/cache.py",
    "modeling/base.py",
    "configuration/position_embedding.py",
    "benchmarks/common.py",
]


def log(message: str = "") -> None:
    print(message, flush=True)


# --------------------------------------------------------------------------------------------------------------------
# machine information and provenance
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
    try:
        import transformers

        transformers_version = transformers.__version__
    except ImportError:  # pragma: no cover - a dependency of the package
        transformers_version = None
    return {
        "processor": platform.processor(),
        "cpu_model": cpu_model_name(),
        "machine": platform.machine(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch_version": torch.__version__,
        "transformers_version": transformers_version,
        "torch_num_threads": torch.get_num_threads(),
        "torch_num_threads_requested": threads,
        "torch_num_interop_threads": torch.get_num_interop_threads(),
        "cpu_count": os.cpu_count(),
        "cpu_count_usable": usable_cores(),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "load_average_start": load_average(),
    }


def source_provenance(files: list[str]) -> dict:
    """git commit, and hashes of the source files the numbers depend on (they may hold uncommitted edits).

    ``files`` are paths relative to the repository root; the shared ones (``SHARED_SOURCES``) are added.
    """
    files = list(dict.fromkeys([*files, *SHARED_SOURCES]))
    info: dict = {"files_sha256_12": {}}
    for name in files:
        path = REPO_ROOT / name
        if path.exists():
            info["files_sha256_12"][name] = hashlib.sha256(path.read_bytes()).hexdigest()[:12]
    try:
        def git(*cmd: str) -> str:
            return subprocess.run(["git", *cmd], cwd=REPO_ROOT, capture_output=True, text=True,
                                  timeout=10, check=False).stdout.rstrip("\n")

        info["git_commit"] = git("rev-parse", "HEAD").strip()
        # "?? path": not yet committed at all; " M path": modified
        info["uncommitted_changes"] = [line[3:] for line in git("status", "--porcelain", "--", *files).splitlines()]
    except (OSError, subprocess.SubprocessError):
        pass
    return info


# --------------------------------------------------------------------------------------------------------------------
# load probing and quiet waiting
# --------------------------------------------------------------------------------------------------------------------
class LoadProbe:
    """CPU time that *other* processes used since the probe started: ``/proc/stat`` busy time minus our own.

    "Our own" is this process and its waited-for children (``os.times``), so a benchmark that runs its measurement
    in a child process counts the child once it has been waited for.
    """

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
        return time.perf_counter(), busy, own.user + own.system + own.children_user + own.children_system

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
        self.gave_up_waiting = 0  # waits that ended because the budget ran out, not because the machine was quiet

    def wait(self, window_s: float = 0.25, quiet_windows: int = 2) -> None:
        """Return once ``quiet_windows`` consecutive windows saw other processes below the threshold."""
        quiet = 0
        while quiet < quiet_windows and self.waited_s < self.max_wait_s:
            probe = LoadProbe()
            time.sleep(window_s)
            self.waited_s += window_s
            busy = probe.others_cores()
            quiet = quiet + 1 if busy is None or busy < BUSY_THRESHOLD else 0
        if quiet < quiet_windows:
            self.gave_up_waiting += 1

    def remaining_s(self) -> float:
        return max(0.0, self.max_wait_s - self.waited_s)

    def absorb(self, summary: dict) -> None:
        """Add the counts of a child process's ``Quiet`` (see ``summary``)."""
        self.waited_s += summary.get("waited_s", 0.0)
        self.redone_rounds += summary.get("redone_rounds", 0)
        self.disturbed_rounds_kept += summary.get("disturbed_rounds_kept", 0)
        self.gave_up_waiting += summary.get("gave_up_waiting", 0)

    def summary(self) -> dict:
        return {"waited_s": round(self.waited_s, 2), "redone_rounds": self.redone_rounds,
                "disturbed_rounds_kept": self.disturbed_rounds_kept, "gave_up_waiting": self.gave_up_waiting,
                "max_wait_s": self.max_wait_s, "max_redo_per_measurement": self.max_redo}


QUIET = Quiet(max_wait_s=0.0, max_redo=0)  # configured by configure()


# --------------------------------------------------------------------------------------------------------------------
# timing
# --------------------------------------------------------------------------------------------------------------------
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
    cpu_times = {name: [] for name in names}  # this process's CPU time per call (all its threads)
    faults = {name: 0 for name in names}
    busy_per_round, redo_left, r = [], QUIET.max_redo, 0
    while r < rounds:
        shift = r % len(names)
        order = names[shift:] + names[:shift]
        probe = LoadProbe()
        this_round = {name: [] for name in names}
        this_round_cpu = {name: [] for name in names}
        round_faults = {}
        for name in order:
            faults_before = minor_faults()
            for _ in range(calls):
                start, start_cpu = time.perf_counter(), time.process_time()
                fns[name]()
                this_round[name].append(time.perf_counter() - start)
                this_round_cpu[name].append(time.process_time() - start_cpu)
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
            cpu_times[name].extend(this_round_cpu[name])
            faults[name] += round_faults[name]
        r += 1
    # minor page faults per call: fresh memory pages the allocator had to map (large temporaries freed to the OS
    # and mapped again on every call show up here)
    return {name: {**summarize(times[name]), "cpu_median_s": statistics.median(cpu_times[name]),
                   "cpu_times_s": [round(t, 6) for t in cpu_times[name]], "rounds": rounds, "calls_per_round": calls,
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


def paired_ratio(stats: dict, name: str, base: str) -> float:
    """Median over calls of time(name) / time(base), pairing the calls of the same round (interleaved runs)."""
    return statistics.median(a / b for a, b in zip(stats[name]["times_s"], stats[base]["times_s"]))


def ratio_spread(stats: dict, name: str, base: str, key: str = "times_s") -> dict:
    """Ratios time(name) / time(base) of the calls paired by round (interleaved runs): median, quartiles, extremes.

    ``key="cpu_times_s"`` pairs the process CPU times instead of wall times (less sensitive to other processes taking
    the cores, but it counts OpenMP threads that spin while waiting)."""
    ratios = sorted(a / b for a, b in zip(stats[name][key], stats[base][key]))
    quartiles = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else ratios * 3
    return {"median": round(statistics.median(ratios), 4), "q1": round(quartiles[0], 4),
            "q3": round(quartiles[2], 4), "min": round(ratios[0], 4), "max": round(ratios[-1], 4),
            "pairs": len(ratios)}


def comparison_record(stats: dict, base: str, unit_scale: float = 1e3) -> dict:
    """Per model: median wall and CPU time, and the paired ratios to ``base`` (wall and CPU) with their spread."""
    record = {}
    for name, s in stats.items():
        record[name] = {"median_ms": round(s["median_s"] * unit_scale, 3), "min_ms": round(s["min_s"] * unit_scale, 3),
                        "cpu_median_ms": round(s["cpu_median_s"] * unit_scale, 3)}
        if name != base:
            record[name]["ratio_to_" + base] = ratio_spread(stats, name, base)
            record[name]["cpu_ratio_to_" + base] = ratio_spread(stats, name, base, key="cpu_times_s")
    return record


def prefill_comparison(models: dict, lengths: list[int], vocab: int, rounds: int, base: str) -> dict:
    """Prefill time of several models (same input) at each length, interleaved round by round (``use_cache=False``,
    batch 1). Returns ``{"rows": [{"seq_len", "models": comparison_record, "timings": ...}]}``."""
    rows = []
    for T in lengths:
        ids = random_ids(T, vocab, seed=3000 + T)
        with torch.inference_mode():
            stats = timed_rounds({name: (lambda m=m, ids=ids: m(ids, use_cache=False)) for name, m in models.items()},
                                 rounds=rounds, min_round_s=0.0)
        record = comparison_record(stats, base)
        rows.append({"seq_len": T, "models": record, "timings": stats})
        log(f"  prefill T={T:5d}: " + "  ".join(_comparison_cell(name, r, base) for name, r in record.items()))
    return {"base": base, "rounds": rounds, "interleaved": True, "use_cache": False, "rows": rows}


def decode_comparison(models: dict, contexts: list[int], vocab: int, rounds: int, steps_per_round: int,
                      warmup_steps: int, base: str) -> dict:
    """Cached greedy decoding of several models after each context, interleaved: per round every model decodes
    ``steps_per_round`` tokens in turn. ms per token; ratios pair the steps of the same round."""
    rows = []
    for ctx in contexts:
        ids = random_ids(ctx, vocab, seed=1000 + ctx)
        states = {}
        with torch.inference_mode():
            for name, model in models.items():
                out = model(ids, use_cache=True)
                states[name] = [out.past_key_values, out.logits[:, -1:].argmax(-1)]

            def step(name: str, states: dict = states) -> None:
                cache, token = states[name]
                out = models[name](token, past_key_values=cache, use_cache=True)
                states[name] = [out.past_key_values, out.logits[:, -1:].argmax(-1)]

            for _ in range(warmup_steps):
                for name in models:
                    step(name)
            stats = timed_rounds({name: (lambda n=name: step(n)) for name in models}, rounds=rounds,
                                 calls=steps_per_round, warmup=0, min_round_s=0.0)
        record = comparison_record(stats, base)
        rows.append({"context": ctx, "models": record, "timings": stats})
        log(f"  decode context={ctx:5d} (ms/token): "
            + "  ".join(_comparison_cell(name, r, base) for name, r in record.items()))
    return {"base": base, "rounds": rounds, "steps_per_round": steps_per_round, "warmup_steps": warmup_steps,
            "interleaved": True, "sampling": "greedy", "rows": rows}


def _comparison_cell(name: str, record: dict, base: str) -> str:
    if name == base:
        return f"{name} {record['median_ms']:.2f}"
    r = record["ratio_to_" + base]
    return f"{name} {record['median_ms']:.2f} ({r['median']:.3f}x [{r['q1']:.3f}-{r['q3']:.3f}])"


def print_comparison(section: dict, title: str, key: str) -> None:
    """A table of ``prefill_comparison`` / ``decode_comparison`` results: medians and paired ratios with quartiles."""
    base = section["base"]
    log(title)
    log(f"   {key:>7} | {'model':>14} | {'median ms':>10} | {'x ' + base + ' (wall), [q1-q3]':>30} | "
        f"{'x ' + base + ' (CPU time)':>20}")
    for row in section["rows"]:
        for name, r in row["models"].items():
            wall = cpu = "-"
            if name != base:
                w, c = r["ratio_to_" + base], r["cpu_ratio_to_" + base]
                wall = f"{w['median']:.3f} [{w['q1']:.3f}-{w['q3']:.3f}]"
                cpu = f"{c['median']:.3f}"
            log(f"   {row[key]:>7} | {name:>14} | {r['median_ms']:>10.2f} | {wall:>30} | {cpu:>20}")


TARGET_SELECTIVE_OVER_NOPE = 1.10  # Selective RoPE decode and prefill at most 1.10x NoPE (GLA, Gated DeltaNet)
COMPARE_PLANS = {
    "quick": {"compare_decode_contexts": [256, 1024], "compare_decode_rounds": 3, "compare_decode_steps_per_round": 4,
              "compare_prefill_lengths": [512, 1024], "compare_prefill_rounds": 3, "compare_decode_warmup": 2},
    "full": {"compare_decode_contexts": [256, 4096], "compare_decode_rounds": 30, "compare_decode_steps_per_round": 8,
             "compare_prefill_lengths": [2048, 8192], "compare_prefill_rounds": 7, "compare_decode_warmup": 4},
}


def selective_vs_nope(build_model: Callable[[str], torch.nn.Module], vocab: int, plan: dict) -> dict:
    """Decode (ms/token) and prefill of the same model (same seed) with NoPE and with Selective RoPE, interleaved;
    a target of ``TARGET_SELECTIVE_OVER_NOPE`` on every paired-ratio median."""
    models = {"nope": build_model("nope"), "selective_rope": build_model("selective_rope")}
    decode = decode_comparison(models, plan["compare_decode_contexts"], vocab, plan["compare_decode_rounds"],
                               plan["compare_decode_steps_per_round"], plan["compare_decode_warmup"], "nope")
    prefill = prefill_comparison(models, plan["compare_prefill_lengths"], vocab, plan["compare_prefill_rounds"],
                                 "nope")
    targets = {}
    for row in decode["rows"]:
        ratio = row["models"]["selective_rope"]["ratio_to_nope"]["median"]
        targets[f"selective_rope / nope decode ms/token at context {row['context']}"] = target(
            ratio, TARGET_SELECTIVE_OVER_NOPE, higher_is_better=False)
    for row in prefill["rows"]:
        ratio = row["models"]["selective_rope"]["ratio_to_nope"]["median"]
        targets[f"selective_rope / nope prefill at T={row['seq_len']}"] = target(
            ratio, TARGET_SELECTIVE_OVER_NOPE, higher_is_better=False)
    return {"num_parameters": {name: num_parameters(m) for name, m in models.items()}, "decode": decode,
            "prefill": prefill, "targets": targets}


def print_selective_vs_nope(section: dict, number: int) -> None:
    print_comparison(section["decode"], f"{number}. Selective RoPE vs NoPE: cached decoding, ms/token (interleaved)",
                     "context")
    print_comparison(section["prefill"], f"{number}. Selective RoPE vs NoPE: prefill, ms (interleaved)", "seq_len")


def run_compare_only(results: dict, args: argparse.Namespace, plan: dict, build_model, vocab: int,
                     start_all: float) -> int:
    """``--compare-only``: the Selective RoPE vs NoPE section alone, printed and written to ``args.output``."""
    contention = run_sections(results, [("compare", "Selective RoPE vs NoPE (decode and prefill, interleaved)",
                                         lambda: selective_vs_nope(build_model, vocab, plan))])
    results["targets"] = results["compare"]["targets"]
    results["all_targets_met"] = all(t["met"] for t in results["targets"].values())
    finish(results, contention, start_all)
    line = print_header(results, f"{results['benchmark']}: Selective RoPE vs NoPE",
                        f"model: {results['model_config'].get('summary', '')}")
    print_selective_vs_nope(results["compare"], 1)
    print_footer(results, line)
    write_results(args.output, results)
    return 0


# --------------------------------------------------------------------------------------------------------------------
# inputs
# --------------------------------------------------------------------------------------------------------------------
def random_ids(length: int, vocab_size: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (1, length), generator=generator)


def num_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# --------------------------------------------------------------------------------------------------------------------
# shared sections of a run
# --------------------------------------------------------------------------------------------------------------------
def decode_contexts(model, contexts: list[int], vocab: int, steps: int, steps_per_round: int,
                    warmup_steps: int) -> dict:
    """Cached greedy decoding after each context: prefill it with ``use_cache=True``, then time single-token steps,
    the contexts taking turns (``steps_per_round`` steps each). Returns ``{"rows": [...], "steps": n}``."""
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
    return {"steps": rows[0]["repeats"], "rows": rows}


def prefill_rows(model, lengths: list[int], vocab: int, repeats: int, **forward_kwargs) -> list[dict]:
    """Prefill time and tokens/s of ``model`` at each length (batch 1, random ids seeded by the length)."""
    rows = []
    for T in lengths:
        ids = random_ids(T, vocab, seed=T)
        with torch.inference_mode():
            stats = timed_rounds({"prefill": lambda ids=ids: model(ids, **forward_kwargs)}, rounds=repeats)["prefill"]
        tokens_per_s = T / stats["median_s"]
        rows.append({"seq_len": T, "tokens_per_s": round(tokens_per_s, 1), **stats})
        log(f"  prefill T={T:5d}: {stats['median_s'] * 1e3:9.1f} ms  ->  {tokens_per_s:9.0f} tokens/s")
    return rows


def decode_result(decoded: dict, steps_per_round: int, warmup_steps: int, goal: float | None) -> dict:
    """The decode section's record from ``decode_contexts``: the ratio of the last context to the first, a target
    when ``goal`` is given."""
    rows = decoded["rows"]
    ratio = rows[-1]["median_s"] / rows[0]["median_s"]
    result = {"position_embedding": "selective_rope", "steps": decoded["steps"], "steps_per_round": steps_per_round,
              "warmup_steps": warmup_steps, "sampling": "greedy", "rows": rows,
              "ratio_name": f"ms/token at {rows[-1]['context']} / at {rows[0]['context']}"}
    if goal is None:
        result["ratio"] = round(ratio, 4)
    else:
        result["ratio_target"] = target(ratio, goal, higher_is_better=False)
    return result


VARIANTS = ("nope", "rope", "selective_rope")


def position_embedding_overhead(build_model: Callable[[str], torch.nn.Module], T: int, vocab: int, rounds: int,
                                rotary_inputs: Callable[[int], tuple], goal: float, seed: int,
                                **forward_kwargs) -> dict:
    """Prefill time of the same model (same seed) with NoPE, RoPE and Selective RoPE at length ``T``, interleaved,
    and of the first layer's rotary module alone (``rotary_inputs(T)`` gives its ``x, q, k``)."""
    models = {name: build_model(name) for name in VARIANTS}
    params = {name: num_parameters(m) for name, m in models.items()}
    ids = random_ids(T, vocab, seed=2024)
    x, q, k = rotary_inputs(T)
    with torch.inference_mode():
        stats = timed_rounds({name: (lambda m=models[name]: m(ids, **forward_kwargs)) for name in VARIANTS},
                             rounds=rounds)
        # the rotary module alone, one layer: what (Selective) RoPE adds to a NoPE layer
        rotary = {name: models[name].model.layers[0].attn.rotary for name in ("rope", "selective_rope")}
        alone = timed_rounds({name: (lambda r=rotary[name]: r(x, q, k)) for name in rotary}, rounds=rounds, calls=3,
                             warmup=2)

    base = stats["nope"]["median_s"]
    layers = len(models["nope"].model.layers)
    result = {"seq_len": T, "batch_size": 1, "use_cache": forward_kwargs.get("use_cache", False), "rounds": rounds,
              "interleaved": True, "seed": seed, "num_parameters": params, "timings": stats,
              "rotary_module_alone": alone}
    for name in ("rope", "selective_rope"):
        ratio = stats[name]["median_s"] / base
        result[f"{name}_over_nope"] = target(ratio, goal, higher_is_better=False)
        result[f"{name}_over_nope"]["paired_round_ratio_median"] = round(paired_ratio(stats, name, "nope"), 4)
        result[f"{name}_over_nope"]["min_over_min"] = round(stats[name]["min_s"] / stats["nope"]["min_s"], 4)
        per_layer = alone[name]["median_s"]
        result[f"{name}_rotary_cost"] = {
            "ms_per_layer": round(per_layer * 1e3, 3),
            "ms_all_layers": round(per_layer * layers * 1e3, 3),
            "fraction_of_nope_prefill": round(per_layer * layers / base, 4),
        }
    for name in VARIANTS:
        extra = ""
        if name != "nope":
            extra = (f"  ({result[f'{name}_over_nope']['value']:.3f}x NoPE; rotary module alone "
                     f"{result[f'{name}_rotary_cost']['ms_all_layers']:.1f} ms over {layers} layers)")
        log(f"  prefill T={T} {name:15s}: {stats[name]['median_s'] * 1e3:8.1f} ms{extra}")
    return result


def profile_overhead(build_model: Callable[[str], torch.nn.Module], T: int, vocab: int,
                     rotary_inputs: Callable[[int], tuple], calls: int = 3, top: int = 12,
                     **forward_kwargs) -> dict:
    """Where Selective RoPE's extra prefill time goes: torch.profiler self-CPU time per op, selective_rope minus
    nope (same seed, same input), and the top ops of the rotary module alone."""
    from torch.profiler import ProfilerActivity, profile

    ids = random_ids(T, vocab, seed=2024)
    per_variant = {}
    QUIET.wait()
    with torch.inference_mode():
        for name in ("nope", "selective_rope"):
            model = build_model(name)
            model(ids, **forward_kwargs)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(calls):
                    model(ids, **forward_kwargs)
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
# printing the shared sections
# --------------------------------------------------------------------------------------------------------------------
def print_prefill_rows(rows: list[dict]) -> None:
    log(f"   {'T':>6} | {'median ms':>10} | {'min ms':>8} | {'tokens/s':>10}")
    for row in rows:
        log(f"   {row['seq_len']:>6} | {row['median_s'] * 1e3:>10.1f} | {row['min_s'] * 1e3:>8.1f} | "
            f"{row['tokens_per_s']:>10.0f}")


def print_decode(dec: dict, number: int) -> None:
    log(f"{number}. Decode (selective_rope, median of {dec['steps']} single-token steps per context, contexts "
        "interleaved)")
    log(f"   {'context':>7} | {'ms/token':>9} | {'min ms':>8} | {'prefill s':>9}")
    for row in dec["rows"]:
        log(f"   {row['context']:>7} | {row['ms_per_token']:>9.2f} | {row['min_s'] * 1e3:>8.2f} | "
            f"{row['prefill_s']:>9.3f}")
    ratio = dec["ratio_target"]["value"] if "ratio_target" in dec else dec["ratio"]
    log(f"   {dec['ratio_name']}: {ratio:.3f}")


def print_overhead(ov: dict, number: int) -> None:
    log(f"{number}. Position-embedding prefill overhead, T={ov['seq_len']} (same seed, {ov['rounds']} interleaved "
        "rounds)")
    log(f"   {'variant':>15} | {'median ms':>10} | {'x NoPE':>7} | {'paired':>7} | {'rotary module, all layers':>25}")
    for name in VARIANTS:
        t = ov["timings"][name]["median_s"] * 1e3
        if name == "nope":
            log(f"   {name:>15} | {t:>10.1f} | {1.0:>7.3f} | {1.0:>7.3f} | {'-':>25}")
        else:
            r = ov[f"{name}_over_nope"]
            cost = ov[f"{name}_rotary_cost"]
            log(f"   {name:>15} | {t:>10.1f} | {r['value']:>7.3f} | {r['paired_round_ratio_median']:>7.3f} | "
                f"{cost['ms_all_layers']:>8.1f} ms ({100 * cost['fraction_of_nope_prefill']:>4.1f}% of NoPE)")


def add_common_arguments(parser: argparse.ArgumentParser, default_output: Path) -> None:
    parser.add_argument("--quick", action="store_true", help="short smoke run (small sizes, few repeats)")
    parser.add_argument("--output", type=Path, default=default_output, help=f"JSON path (default {default_output})")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (default: the number of usable CPU cores)")
    parser.add_argument("--max-wait", type=float, default=None,
                        help="seconds in all to wait for other processes to go quiet (default 180, quick 10)")
    parser.add_argument("--max-redo", type=int, default=None,
                        help="disturbed rounds run again per measurement (default 8, quick 1)")
    parser.add_argument("--compare-only", action="store_true",
                        help="only the interleaved comparison section (see the script's description)")


def configure(args: argparse.Namespace, seed: int) -> int:
    """Threads, seed and the quiet-waiting budget from the command line; returns the thread count asked for."""
    threads = args.threads or usable_cores()
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    QUIET.max_wait_s = args.max_wait if args.max_wait is not None else (10.0 if args.quick else 180.0)
    QUIET.max_redo = args.max_redo if args.max_redo is not None else (1 if args.quick else 8)
    return threads


def start_results(name: str, args: argparse.Namespace, threads: int, source_files: list[str], plan: dict) -> dict:
    return {"benchmark": name, "mode": "quick" if args.quick else "full",
            "command": " ".join(["python", os.path.relpath(sys.argv[0], REPO_ROOT), *sys.argv[1:]]),
            "device": device_info(threads),
            "source": source_provenance(source_files), "plan": plan}


def run_sections(results: dict, sections: list[tuple[str, str, Callable[[], dict]]]) -> dict:
    """Run ``(key, title, fn)`` sections in turn, each after waiting for a quiet machine; ``results[key] = fn()``.

    Returns the per-section contention record: wall time, cores kept busy by other processes (waits included) and
    the load average before and after.
    """
    contention: dict = {}
    for key, title, run in sections:
        log(title)
        load_before = load_average()
        QUIET.wait()
        probe = LoadProbe()
        start = time.perf_counter()
        results[key] = run()
        busy = probe.others_cores()
        contention[key] = {"wall_s": round(time.perf_counter() - start, 2),
                           "others_cores": None if busy is None else round(busy, 2),
                           "load_average_before": load_before, "load_average_after": load_average()}
    return contention


def finish(results: dict, contention: dict, start_all: float) -> None:
    """Contention summary, end load, total wall time and (when disturbed rounds were kept) a warning."""
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


def print_header(results: dict, title: str, model_line: str, width: int = 104) -> str:
    info = results["device"]
    line = "=" * width
    log()
    log(line)
    log(f"{title} ({results['mode']})  |  {info['cpu_model'] or info['processor'] or info['machine']}")
    log(f"torch {info['torch_version']}  |  threads {info['torch_num_threads']} / cpu_count {info['cpu_count']}  |  "
        f"{info['date']}  |  load avg start {info['load_average_start']} end {info['load_average_end']}")
    log(model_line)
    log(line)
    return line


def print_footer(results: dict, line: str) -> None:
    log(line)
    log("Targets")
    for key, goal in results["targets"].items():
        status = "MET" if goal["met"] else "MISSED"
        log(f"   {key:50s} {goal['value']:>8.3f}  (target {goal['comparison']} {goal['target']})  {status}")
    busy = ", ".join(f"{key} {c['others_cores'] if c.get('others_cores') is not None else float('nan'):.2f}"
                     for key, c in results["contention"].items() if isinstance(c, dict) and "wall_s" in c)
    log(f"cores kept busy by other processes, per section (including any waits): {busy}")
    quiet = results["contention"]["quiet"]
    log(f"waited for a quiet machine {quiet['waited_s']:.1f} s, redid {quiet['redone_rounds']} disturbed rounds, "
        f"kept {quiet['disturbed_rounds_kept']} disturbed rounds")
    log(f"total wall time {results['total_wall_s']:.1f} s")
    log(line)
    if "warning" in results:
        log(f"WARNING: {results['warning']}")


def write_results(path: Path, results: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2, default=str) + "\n")
    log(f"saved {path}")
