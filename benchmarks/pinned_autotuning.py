"""One configuration per autotuned Triton kernel in benchmarks: the saved autotuning choice where Triton's disk cache
holds one, otherwise the kernel's first candidate, never a fresh autotuning.

flash-linear-attention's training kernels time ~300 configurations on their first call for each shape: on an H200 the
first GLA training step took 250 s and its packed step more than 390 s (benchmarks/results/gpu/2026-11-27-h200, run
5), which no 15-minute lease can afford. ``scripts/gpu_check.sh`` restores the archive of earlier runs' choices into
Triton's cache (its key holds the arch, "90" on every H100 and H200, not the card's name), so a kernel tuned before
runs its tuned configuration; a kernel never tuned runs its first candidate. NoPE, RoPE and Selective RoPE rows of a
family call the same fla kernels, so their ratios are unaffected; the absolute figure of a row whose kernels ran
their first candidate may be below what a tuned run gives, and the results say which kernels did
(:func:`first_candidates`).
"""

from __future__ import annotations

import contextlib

from triton.runtime import autotuner

_first_candidates: list[str] = []


class _NotSaved(Exception):
    """Raised inside Triton's ``check_disk_cache`` instead of benchmarking, so nothing is written to the cache."""


def first_candidates() -> list[str]:
    """The kernels that ran their first candidate (no saved choice), in the order they were first called."""
    return list(dict.fromkeys(_first_candidates))


@contextlib.contextmanager
def saved_or_first_configuration():
    check_disk_cache = autotuner.Autotuner.check_disk_cache
    run = autotuner.Autotuner.run
    switched_on = []  # the autotuners whose ``cache_results`` was off: set back when the context ends

    def saved_or_first(self, tuning_key, configs, bench_fn):
        def first_candidate():
            self.cache[tuning_key] = configs[0]
            self.configs_timings = {configs[0]: [0.0]}
            raise _NotSaved

        try:
            return check_disk_cache(self, tuning_key, configs, first_candidate)
        except _NotSaved:  # (Triton writes the cache entry after bench_fn returns: never for a pinned choice)
            _first_candidates.append(self.base_fn.__name__)
            return False

    def run_with_cache_lookup(self, *args, **kwargs):
        if not self.cache_results:  # a kernel made without ``cache_results`` would otherwise benchmark every candidate
            self.cache_results = True
            switched_on.append(self)
        return run(self, *args, **kwargs)

    autotuner.Autotuner.check_disk_cache = saved_or_first
    autotuner.Autotuner.run = run_with_cache_lookup
    try:
        yield
    finally:
        autotuner.Autotuner.check_disk_cache = check_disk_cache
        autotuner.Autotuner.run = run
        for tuner in switched_on:
            tuner.cache_results = False
