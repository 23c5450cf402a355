"""Padding and packing, in one place.

The mixers only ever see dense, right-padded rows ``(N, L, ...)`` plus the number of real tokens per row
(``lengths``, or ``None`` when every row is full). Causal operators then never let a pad reach a real token; the
mixers only have to keep pads out of their carried states. Two inputs map onto that form:

- an ``attention_mask`` with padding anywhere (left padding from ``generate``): each row's real tokens are moved to
  its front, in order (so pads neither advance the phase nor enter a convolution history);
- packed sequences, ``(1, total)`` with ``cu_seqlens`` (flash-linear-attention's convention): one row per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def is_integer(tensor: torch.Tensor) -> bool:
    """An integer tensor (not bool, floating or complex)."""
    return not (tensor.is_floating_point() or tensor.is_complex() or tensor.dtype == torch.bool)


def check_offsets(name: str, offsets, total: int) -> torch.Tensor:
    """``offsets`` as given, checked: a 1-D integer tensor ``[0, ..., total]``, non-decreasing (flash-linear-attention's
    ``cu_seqlens``); a one-line ``ValueError`` naming ``name`` otherwise."""
    if not isinstance(offsets, torch.Tensor):
        raise ValueError(f"{name} must be a 1-D integer tensor of offsets [0, ..., {total}]; got "
                         f"{type(offsets).__name__}")
    if offsets.dim() != 1 or offsets.numel() < 2 or not is_integer(offsets):
        raise ValueError(f"{name} must be a 1-D integer tensor of offsets [0, ..., {total}]; got {offsets.dtype} of "
                         f"shape {tuple(offsets.shape)}")
    if int(offsets[0]) != 0 or int(offsets[-1]) != total or bool((offsets.diff() < 0).any()):
        raise ValueError(f"{name} must be non-decreasing offsets starting at 0 and ending at the packed length "
                         f"{total}; got {offsets.tolist()}")
    return offsets


def valid_mask(lengths: torch.Tensor, seq_len: int) -> torch.Tensor:
    """``(N, seq_len)`` bool, True at the first ``lengths[n]`` positions of each right-padded row."""
    return torch.arange(seq_len, device=lengths.device) < lengths[:, None]


@dataclass
class SequenceLayout:
    index: torch.Tensor  # (N, L): position of each row slot in the caller's flattened (B * T) token grid
    lengths: torch.Tensor  # (N,): real tokens per row
    grid: tuple[int, int]  # the caller's (B, T)

    @classmethod
    def from_attention_mask(cls, attention_mask: torch.Tensor) -> SequenceLayout | None:
        """``attention_mask``: ``(B, T)`` with 1 for real tokens. ``None`` when nothing is padded."""
        mask = attention_mask.bool()
        if bool(mask.all()):
            return None
        batch, seq_len = mask.shape
        order = torch.argsort((~mask).to(torch.int8), dim=1, stable=True)  # real tokens first, in order
        offsets = torch.arange(batch, device=mask.device).unsqueeze(1) * seq_len
        return cls(index=order + offsets, lengths=mask.sum(dim=1), grid=(batch, seq_len))

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens: torch.Tensor, total: int) -> SequenceLayout:
        """``cu_seqlens``: int offsets ``[0, l_1, l_1 + l_2, ..., total]`` of sequences packed in one row."""
        cu_seqlens = check_offsets("cu_seqlens", cu_seqlens, total).long()
        lengths = cu_seqlens.diff()
        longest = max(int(lengths.max()), 1)
        slots = torch.arange(longest, device=cu_seqlens.device)
        # Pad slots point at a real token of the same row (or token 0): their content is never used.
        index = cu_seqlens[:-1, None] + torch.minimum(slots, (lengths[:, None] - 1).clamp(min=0))
        return cls(index=index.clamp(max=max(total - 1, 0)), lengths=lengths, grid=(1, total))

    @property
    def valid(self) -> torch.Tensor:
        """``(N, L)`` bool, True at real tokens."""
        return valid_mask(self.lengths, self.index.shape[1])

    def to_rows(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, T, ...)`` -> ``(N, L, ...)``."""
        flat = x.reshape(-1, *x.shape[2:])
        return flat[self.index]

    def from_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """``(N, L, ...)`` -> ``(B, T, ...)``; positions that held no real token are zero."""
        batch, seq_len = self.grid
        valid = self.valid
        out = rows.new_zeros(batch * seq_len, *rows.shape[2:])
        out = out.index_put((self.index[valid],), rows[valid])
        return out.view(batch, seq_len, *rows.shape[2:])


@dataclass
class AttentionLayout:
    """Attention weights over a mixer's rows ``(N, H, L, past + L)`` and over the caller's grid ``(B, H, T, past + T)``,
    for a padding layout (``SequenceLayout.from_attention_mask``: row n is batch row n, ``L == T``). Queries and this
    call's keys go back to their columns; the ``past`` cached key slots stay in the order the cache holds them. The
    two maps are exact inverses on the real entries; every other entry is zero."""

    rows: SequenceLayout
    past: int

    def _key_columns(self, weights: torch.Tensor) -> torch.Tensor:
        """``(B, H, T, T)``: the grid column (offset by ``past``) of each row slot's key, a permutation per row."""
        batch, seq_len = self.rows.grid
        columns = self.rows.index - torch.arange(batch, device=self.rows.index.device)[:, None] * seq_len  # (B, T)
        return (self.past + columns)[:, None, None, :].expand(*weights.shape[:3], -1)

    def to_caller(self, weights: torch.Tensor) -> torch.Tensor:
        keys = torch.cat([weights[..., : self.past], torch.zeros_like(weights[..., self.past :])], dim=-1)
        keys = keys.scatter(-1, self._key_columns(weights), weights[..., self.past :])  # keys to their columns
        return self.rows.from_rows(keys.transpose(1, 2)).transpose(1, 2)  # queries to their rows

    def from_caller(self, weights: torch.Tensor) -> torch.Tensor:
        rows = self.rows.to_rows(weights.transpose(1, 2)).transpose(1, 2)  # (B, H, T, past + T), queries in rows
        return torch.cat([rows[..., : self.past], rows.gather(-1, self._key_columns(rows))], dim=-1)
