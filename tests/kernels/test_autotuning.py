"""tests/autotuning.py: on a GPU the tests' autotuned kernels time a few configurations, cached apart."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from autotuning import few_autotuning_candidates
from triton.runtime import autotuner

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
