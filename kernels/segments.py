"""Splitting the time axis: long inputs as consecutive segments of whole chunks, shared by the chunked torch ops
(GLA, gated delta rule), and the sequence each token of a packed input belongs to.

A chunked op run on a long input at once allocates (B, H, T, D) temporaries that the CPU allocator maps freshly on
every call (page faults); run segment by segment, carrying the state, the temporaries stay small, are recycled and
stay in cache.
"""

from __future__ import annotations

import torch


def check_chunk_size(chunk_size: int) -> None:
    if chunk_size < 1 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two, got {chunk_size}")


def segment_slices(seq_len: int, chunk_size: int, elements_per_chunk: int, segment_elements: int) -> list[slice]:
    """Time slices covering ``[0, seq_len)``, each a whole number of chunks (at least one) whose temporaries hold
    about ``segment_elements`` elements, given ``elements_per_chunk`` for one chunk."""
    tokens = chunk_size * max(1, segment_elements // elements_per_chunk)
    return [slice(start, start + tokens) for start in range(0, seq_len, tokens)]


def packed_positions(cu_seqlens: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For sequences packed in one row (offsets ``cu_seqlens`` ``[0, ..., total]``, empty sequences allowed): the
    sequence of each token and its position in that sequence, both ``(total,)`` int64. No device sync."""
    cu_seqlens = cu_seqlens.long()
    tokens = torch.arange(total, device=cu_seqlens.device)
    sequence = torch.searchsorted(cu_seqlens[1:], tokens, right=True)  # ends <= t: the sequences before t's
    return sequence, tokens - cu_seqlens[sequence]
