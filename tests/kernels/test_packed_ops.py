"""The pure-PyTorch pieces of the packed (``cu_seqlens``) path that fla's kernels do not cover: the causal short
convolution and FoX's key/value token shift restart at every boundary and carry one state per sequence, exactly as
each sequence run alone."""

from __future__ import annotations

import pytest
import torch

from selective_rope.kernels.conv_torch import causal_conv1d
from selective_rope.modeling.fox import last_real, token_shift

LENGTHS = [3, 0, 1, 6, 2, 0]  # empty sequences too, one of them last


def packed(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def spans(cu_seqlens):
    return [slice(int(a), int(b)) for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:])]


@pytest.mark.parametrize("kernel_size", [1, 2, 4])
@pytest.mark.parametrize("with_state", [False, True], ids=["start", "continue"])
def test_causal_conv1d_packed_equals_each_sequence_alone(kernel_size, with_state):
    cu_seqlens, channels = packed(LENGTHS), 5
    x = torch.randn(1, sum(LENGTHS), channels, requires_grad=True)
    weight = torch.randn(channels, kernel_size, requires_grad=True)
    state = torch.randn(len(LENGTHS), kernel_size - 1, channels) if with_state else None
    y, final = causal_conv1d(x, weight, state, activation="silu", cu_seqlens=cu_seqlens)
    assert y.shape == x.shape and final.shape == (len(LENGTHS), kernel_size - 1, channels)
    for n, span in enumerate(spans(cu_seqlens)):
        alone_state = None if state is None else state[n : n + 1]
        y_alone, final_alone = causal_conv1d(x[:, span], weight, alone_state, activation="silu")
        torch.testing.assert_close(y[:, span], y_alone, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(final[n], final_alone[0])
    dx, dw = torch.autograd.grad((y * torch.randn_like(y)).sum(), (x, weight))
    assert torch.isfinite(dx).all() and torch.isfinite(dw).all()


def test_causal_conv1d_refuses_lengths_with_cu_seqlens():
    with pytest.raises(ValueError, match="not both"):
        causal_conv1d(torch.randn(1, 4, 2), torch.randn(2, 3), lengths=torch.tensor([4]),
                      cu_seqlens=torch.tensor([0, 4]))


@pytest.mark.parametrize("with_state", [False, True], ids=["start", "continue"])
def test_token_shift_and_last_real_packed_equal_each_sequence_alone(with_state):
    cu_seqlens = packed(LENGTHS)
    x = torch.randn(1, sum(LENGTHS), 2, 3)
    alpha = torch.rand(1, sum(LENGTHS), 2)
    previous = torch.randn(len(LENGTHS), 2, 3) if with_state else None
    shifted = token_shift(x, alpha, previous, cu_seqlens)
    last = last_real(x, None, previous, cu_seqlens)
    for n, span in enumerate(spans(cu_seqlens)):
        alone_previous = None if previous is None else previous[n : n + 1]
        torch.testing.assert_close(shifted[:, span], token_shift(x[:, span], alpha[:, span], alone_previous))
        expected = x[0, span][-1] if span.stop > span.start else (
            torch.zeros(2, 3) if previous is None else previous[n])  # an empty sequence keeps its state
        torch.testing.assert_close(last[n], expected)
