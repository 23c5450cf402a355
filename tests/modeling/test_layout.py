"""Padding and packing (modeling/layout.py): the caller's tokens as dense right-padded rows and back, against
layouts built by hand; the offsets checks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from selective_rope.modeling.layout import AttentionLayout, SequenceLayout, check_offsets, valid_mask


def test_valid_mask_marks_the_first_lengths_positions():
    assert valid_mask(torch.tensor([0, 2, 4]), 4).tolist() == [[False] * 4, [True, True, False, False], [True] * 4]


def test_an_unpadded_mask_needs_no_layout():
    assert SequenceLayout.from_attention_mask(torch.ones(2, 5, dtype=torch.long)) is None


@settings(max_examples=40, deadline=None, database=None)
@given(rows=st.lists(st.lists(st.booleans(), min_size=6, max_size=6), min_size=1, max_size=4).filter(
    lambda rows: not all(all(row) for row in rows)))
def test_padding_anywhere_moves_each_rows_tokens_to_its_front_in_order(rows):
    mask = torch.tensor(rows)
    x = torch.randn(*mask.shape, 3)
    layout = SequenceLayout.from_attention_mask(mask.long())
    dense = layout.to_rows(x)  # (B, T, 3) -> (B, T, 3), real tokens first
    assert layout.lengths.tolist() == mask.sum(1).tolist()
    for row in range(mask.shape[0]):
        n = int(mask[row].sum())
        assert torch.equal(dense[row, :n], x[row, mask[row]])  # the row's real tokens, in their order
    back = layout.from_rows(dense)
    assert torch.equal(back, x * mask[..., None])  # round trip; pads come back as zeros


@settings(max_examples=40, deadline=None, database=None)
@given(lengths=st.lists(st.integers(0, 5), min_size=1, max_size=5).filter(lambda lengths: sum(lengths) > 0))
def test_packed_sequences_become_one_row_each_and_come_back(lengths):
    total = sum(lengths)
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    x = torch.randn(1, total, 2)
    layout = SequenceLayout.from_cu_seqlens(offsets, total)
    rows = layout.to_rows(x)  # (1, total, 2) -> (N, longest, 2)
    assert rows.shape == (len(lengths), max(lengths), 2) and layout.lengths.tolist() == lengths
    assert torch.equal(layout.valid, valid_mask(torch.tensor(lengths), max(lengths)))
    for i, (start, n) in enumerate(zip(offsets[:-1].tolist(), lengths)):
        assert torch.equal(rows[i, :n], x[0, start:start + n])
    assert torch.equal(layout.from_rows(rows), x)


@pytest.mark.parametrize("offsets,words", [
    ([0, 3], "1-D integer tensor"),  # a list, not a tensor
    (torch.tensor([[0, 3]]), "shape (1, 2)"),
    (torch.tensor([0.0, 3.0]), "torch.float32"),
    (torch.tensor([0]), "shape (1,)"),
    (torch.tensor([1, 3]), "starting at 0"),
    (torch.tensor([0, 2]), "ending at the packed length 3"),
    (torch.tensor([0, 2, 1, 3]), "non-decreasing"),
])
def test_bad_offsets_are_refused_naming_the_argument(offsets, words):
    with pytest.raises(ValueError, match="cu_seqlens") as error:
        check_offsets("cu_seqlens", offsets, 3)
    assert words in str(error.value) and "\n" not in str(error.value)


def test_good_offsets_pass_unchanged():
    offsets = torch.tensor([0, 0, 2, 3], dtype=torch.int32)
    assert check_offsets("cu_seqlens", offsets, 3) is offsets


@pytest.mark.parametrize("past", [0, 3])
def test_attention_weights_go_to_the_callers_columns_and_back(past):
    """AttentionLayout: entry (query slot i, key slot j) of row n lands at (column of i, past + column of j); the
    cached key slots keep their places; the way back is exact on the real entries."""
    mask = torch.tensor([[0, 1, 0, 1, 1], [1, 1, 1, 1, 1], [1, 1, 0, 0, 1]], dtype=torch.bool)
    rows = SequenceLayout.from_attention_mask(mask)
    real = rows.valid  # (B, T) real row slots
    weights = torch.randn(3, 2, 5, past + 5)
    weights = weights * real[:, None, :, None]  # a query at a padding slot has no weights
    weights[..., past:] *= real[:, None, None, :]  # nor has a padding key
    layout = AttentionLayout(rows, past)
    grid = layout.to_caller(weights)
    for n in range(3):
        columns = mask[n].nonzero().flatten().tolist()  # the grid column of each real row slot, in order
        for i, qi in enumerate(columns):
            torch.testing.assert_close(grid[n, :, qi, :past], weights[n, :, i, :past], rtol=0, atol=0)
            for j, kj in enumerate(columns):
                torch.testing.assert_close(grid[n, :, qi, past + kj], weights[n, :, i, past + j], rtol=0, atol=0)
    assert not grid[~mask[:, None, :].expand(3, 2, 5)].any()  # queries at padding: zero
    assert not grid[..., past:][~mask[:, None, None, :].expand(3, 2, 5, 5)].any()  # keys at padding: zero
    torch.testing.assert_close(layout.from_caller(grid), weights, rtol=0, atol=0)
