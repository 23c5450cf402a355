"""tests/autotuning.py: on a GPU the tests' autotuned kernels time a few configurations, cached apart."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from autotuning import few_autotuning_candidates
from triton.runtime import autotuner

# Only torch, triton and our kernels: scripts/test_minimum_versions.sh skips it (tests/cli/test_floor_independent.py).
pytestmark = pytest.mark.floor_independent

CONFIGS = [triton.Config({"BLOCK": block}, num_warps=warps) for block in (2, 4, 8) for warps in (1, 2)]


@triton.autotune(configs=CONFIGS, key=["n"], cache_results=True)
@triton.jit
def _copy(x, y, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y + offsets, tl.load(x + offsets, mask=offsets < n), mask=offsets < n)


def _run(n: int, monkeypatch) -> tuple[list, list]:
    """Runs the kernel once on a fresh key; returns the configurations timed and those the disk cache was keyed by."""
    timed, keyed = [], []

    def bench(self, *args, config, **meta):
        timed.append(config)
        return [float(len(timed))] * 3  # the first configuration timed is the fastest

    def disk_cache(self, tuning_key, configs, bench_fn):
        keyed.extend(configs)
        bench_fn()
        return False

    monkeypatch.setattr(autotuner.Autotuner, "_bench", bench)
    monkeypatch.setattr(autotuner.Autotuner, "check_disk_cache", disk_cache)
    monkeypatch.setattr(_copy, "cache_results", True)  # (off under the interpreter, which has no disk cache)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.arange(n, dtype=torch.float32, device=device)
    y = torch.empty_like(x)
    _copy[lambda meta: (triton.cdiv(n, meta["BLOCK"]),)](x, y, n)
    torch.testing.assert_close(y, x, rtol=0, atol=0)
    return timed, keyed


def test_the_tests_time_the_first_few_configurations_and_cache_them_apart(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("on a GPU the session fixture already limits the candidates; this test checks the limit itself")
    timed, keyed = _run(5, monkeypatch)
    assert timed == CONFIGS == keyed  # without the limit: every configuration
    with few_autotuning_candidates(limit=4):
        timed, keyed = _run(7, monkeypatch)
    assert timed == CONFIGS[:4] == keyed  # the disk cache's key hashes exactly the configurations timed
    assert autotuner.Autotuner.prune_configs(_copy, {}) == CONFIGS  # restored


def test_benchmarks_run_the_saved_choice_or_the_first_candidate_and_never_autotune(monkeypatch):
    """benchmarks/pinned_autotuning.py: a kernel whose choice Triton's disk cache holds runs it; any other runs its
    first candidate, untimed, and nothing is written to the cache. The disk cache is a dict here, with Triton's
    contract (the interpreter has none): a saved entry sets the choice and returns True; otherwise ``bench_fn`` runs
    and its timings are written."""
    if torch.cuda.is_available():
        pytest.skip("on a GPU the session fixture already limits the tests' candidates to one")
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from pinned_autotuning import first_candidates, saved_or_first_configuration

    disk = {}

    def check_disk_cache(self, tuning_key, configs, bench_fn):
        entry = (tuning_key, tuple(map(str, configs)))
        if entry in disk:
            self.cache[tuning_key] = min(disk[entry], key=disk[entry].get)
            return True
        bench_fn()
        disk[entry] = dict(self.configs_timings)
        return False

    timed = []
    monkeypatch.setattr(autotuner.Autotuner, "check_disk_cache", check_disk_cache)
    monkeypatch.setattr(autotuner.Autotuner, "_bench", lambda self, *a, config, **k: timed.append(config) or [1.0])
    monkeypatch.setattr(_copy, "cache_results", False)  # the benchmarks look the cache up even so
    monkeypatch.setattr(_copy, "cache", {})  # (choices made in memory by the test above)
    saved_key = (8, "torch.float32", "torch.float32")
    disk[(saved_key, tuple(map(str, CONFIGS)))] = {config: [1.0 if i == 3 else 2.0] for i, config in enumerate(CONFIGS)}

    device = "cuda" if torch.cuda.is_available() else "cpu"
    with saved_or_first_configuration():
        for n in (8, 5):
            x = torch.arange(n, dtype=torch.float32, device=device)
            y = torch.empty_like(x)
            _copy[lambda meta, n=n: (triton.cdiv(n, meta["BLOCK"]),)](x, y, n)
            torch.testing.assert_close(y, x, rtol=0, atol=0)
    assert _copy.cache[saved_key] == CONFIGS[3]  # the saved choice
    assert _copy.cache[(5, "torch.float32", "torch.float32")] == CONFIGS[0]  # none saved: the first candidate
    assert timed == [] and first_candidates() == ["_copy"]
    assert len(disk) == 1  # nothing written for the pinned choice
    assert autotuner.Autotuner.check_disk_cache is check_disk_cache  # restored
    assert _copy.cache_results is False  # as the kernel was made (here: as the test set it)
