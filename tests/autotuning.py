"""Fewer autotuning candidates for Triton kernels in tests on a GPU.

flash-linear-attention's training kernels autotune on their first call for each shape, compiling and timing every
configuration (~300 for Gated DeltaNet's forward and backward): on an H200 the first such test did not finish within
two minutes, in five runs. Tests check values, not speed, so while :func:`few_autotuning_candidates` is active each
autotuned kernel runs its first configuration after its own pruning (``limit``: how many it may time; Triton 3.6
still times a single candidate once, 3.9 does not). Triton's on-disk autotuning
cache keys its entries by the configurations timed, so these choices are stored apart from a benchmark's full-list
results: the tests neither use nor overwrite them.
"""

from __future__ import annotations

import contextlib

import pytest
from triton.runtime import autotuner

CANDIDATES = 1


@contextlib.contextmanager
def few_autotuning_candidates(limit: int = CANDIDATES):
    prune = autotuner.Autotuner.prune_configs

    def first_candidates(self, kwargs):
        return prune(self, kwargs)[:limit]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(autotuner.Autotuner, "prune_configs", first_candidates)
        yield
