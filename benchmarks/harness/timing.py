"""Timing: interleaved rounds and their records.

``timed_rounds`` times several functions that take turns inside each round (so a change of machine load hits all of
them alike); a round disturbed by other processes is thrown away and run again (the run's ``Quiet`` decides how
often). ``summarize``, ``target`` and ``paired_ratio`` make the JSON records of timings and targets.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

from .machine import BUSY_THRESHOLD, LoadProbe, Quiet


def timed_rounds(fns: dict[str, Callable[[], object]], rounds: int, quiet: Quiet, calls: int = 1, warmup: int = 1,
                 min_round_s: float = 0.1) -> dict:
    """Time every function in ``fns`` ``calls`` times per round, the functions taking turns (the first one rotates).

    ``calls`` is raised so that a round lasts at least ``min_round_s`` (judged from the last warm-up), long enough for
    ``/proc/stat`` to tell whether another process ran meanwhile. A round during which other processes kept more than
    ``BUSY_THRESHOLD`` cores busy is thrown away and run again after waiting for a quiet machine (at most
    ``quiet.max_redo`` times per measurement). Returns ``{name: summary}`` in seconds per call.
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
    busy_per_round, redo_left, r = [], quiet.max_redo, 0
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
                quiet.redone_rounds += 1
                quiet.wait()
                continue
            quiet.disturbed_rounds_kept += 1
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
