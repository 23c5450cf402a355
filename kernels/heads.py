"""Grouped heads (GQA), expanded in one place for the ops that take one key head per query (or value) head."""

from __future__ import annotations

import torch


def repeat_heads(groups: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each tensor ``(B, T, H, ...)`` -> ``(B, T, H·groups, ...)``: head ``h`` serves the ``groups`` consecutive heads
    ``h·groups .. h·groups + groups - 1`` (transformers' and flash-linear-attention's grouping)."""
    if groups == 1:
        return tensors
    return tuple(t.repeat_interleave(groups, dim=2) for t in tensors)
