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
    """Outputs and final states bit for bit (the packed path recomputes each sequence's first K-1 outputs from the
    same products in the same order), and the gradients of the input, the taps and the histories within rounding:
    sequences of 0 to 6 tokens, shorter and longer than the K-1 taps that reach before them."""
    cu_seqlens, channels = packed(LENGTHS), 5
    x = torch.randn(1, sum(LENGTHS), channels, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(channels, kernel_size, requires_grad=True)
    state = (torch.randn(len(LENGTHS), kernel_size - 1, channels, dtype=torch.float64, requires_grad=True)
             if with_state else None)
    y, final = causal_conv1d(x, weight, state, cu_seqlens=cu_seqlens)  # (silu's bits depend on the tensor's size)
    assert y.shape == x.shape and final.shape == (len(LENGTHS), kernel_size - 1, channels)
    grad_y, grad_final = torch.randn_like(y), torch.randn_like(final)
    loss_alone = 0
    for n, span in enumerate(spans(cu_seqlens)):
        alone_state = None if state is None else state[n : n + 1]
        y_alone, final_alone = causal_conv1d(x[:, span], weight, alone_state)
        assert torch.equal(y[:, span], y_alone) and torch.equal(final[n], final_alone[0]), n
        loss_alone = loss_alone + (y_alone * grad_y[:, span]).sum() + (final_alone[0] * grad_final[n]).sum()
    inputs = (x, weight) + (() if state is None else (state,))
    packed_grads = torch.autograd.grad((y * grad_y).sum() + (final * grad_final).sum(), inputs)
    alone_grads = torch.autograd.grad(loss_alone, inputs)
    for name, a, e in zip(("x", "weight", "state"), packed_grads, alone_grads):
        tolerance = 1e-6 if a.dtype == torch.float32 else 1e-12  # the float32 taps' gradient, summed in other orders
        torch.testing.assert_close(a, e, rtol=tolerance, atol=tolerance, msg=lambda m, name=name: f"{name}: {m}")


def test_causal_conv1d_packed_in_training_equals_inference():
    """Many short sequences in one row (the first one empty): the training path (the taps' own backward, then the
    boundary outputs written over the row's) gives the no-gradient path's values bit for bit."""
    lengths = [0, 2, 1, 5, 3, 3, 1, 4]
    cu_seqlens, channels = packed(lengths), 6
    x = torch.randn(1, sum(lengths), channels, requires_grad=True)
    weight = torch.randn(channels, 4, requires_grad=True)
    state = torch.randn(len(lengths), 3, channels)
    y, final = causal_conv1d(x, weight, state, activation="silu", cu_seqlens=cu_seqlens)
    with torch.no_grad():
        y_inference, final_inference = causal_conv1d(x, weight, state, activation="silu", cu_seqlens=cu_seqlens)
    assert torch.equal(y, y_inference) and torch.equal(final, final_inference)


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
