"""Helpers shared by the example scripts under examples/ (not part of the library).

Each script puts this folder on ``sys.path`` before importing from here, so it runs the same way whether started as
``python examples/<area>/<script>.py`` from anywhere or imported by the tests in tests/cli/.
"""

from __future__ import annotations

import math


def lr_at(step: int, steps: int, lr: float, warmup: float = 0.05, floor: float = 0.1) -> float:
    """Linear warm-up over ``warmup`` of the steps, then cosine decay from ``lr`` to ``floor * lr``."""
    warm = max(1, int(warmup * steps))
    if step < warm:
        return lr * (step + 1) / warm
    progress = (step - warm) / max(1, steps - warm)
    return lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))
