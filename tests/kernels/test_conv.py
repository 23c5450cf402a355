"""The dense causal short convolution's training path (``conv_torch._CausalTaps``, its own backward) against autograd
through the plain shifted products it replaces."""

from __future__ import annotations

import pytest
import torch

from selective_rope.kernels.conv_torch import _CausalTaps, causal_conv1d

# Only torch, triton and our kernels: scripts/test_minimum_versions.sh skips it (tests/cli/test_floor_independent.py).
pytestmark = pytest.mark.floor_independent


def products_reference(x, weight, state):
    """``y_t = Σ_j weight[:, j] · history_{t+j}`` over ``history = [state; x]``, through autograd."""
    history = torch.cat([state, x], dim=1)
    return sum(history[:, j : j + x.shape[1]] * weight[:, j] for j in range(weight.shape[-1]))


@pytest.mark.parametrize("kernel_size", [1, 2, 4])
def test_training_convolution_equals_autograd_through_the_products(kernel_size):
    """Values bit for bit (the same products summed in the same order), and the gradients of the input, the
    initial state and the (float32) taps within float64 rounding; the final state as before."""
    x = torch.randn(3, 9, 5, dtype=torch.float64, requires_grad=True)
    state = torch.randn(3, kernel_size - 1, 5, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(5, kernel_size, requires_grad=True)
    y, final = causal_conv1d(x, weight, state)
    expected = products_reference(x, weight.double(), state)
    assert torch.equal(y, expected)
    assert torch.equal(final, torch.cat([state, x], dim=1)[:, 9:])
    grad = torch.randn_like(y)
    actual = torch.autograd.grad(y, (x, state, weight), grad)
    wanted = torch.autograd.grad(expected, (x, state, weight), grad)
    for name, a, e in zip(("x", "initial state", "weight"), actual, wanted):
        assert a.dtype == e.dtype, name
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12, msg=lambda m, name=name: f"{name}: {m}")


def test_training_convolution_has_second_derivatives():
    history = torch.randn(2, 6, 3, dtype=torch.float64, requires_grad=True)
    taps = torch.randn(3, 3, dtype=torch.float64, requires_grad=True)  # (K, C)
    inputs = (history, taps)
    assert torch.autograd.gradcheck(lambda h, t: _CausalTaps.apply(h, t, 4), inputs)
    assert torch.autograd.gradgradcheck(lambda h, t: _CausalTaps.apply(h, t, 4), inputs)


def test_training_convolution_with_padding_and_silu_matches_inference():
    """With ``lengths`` (right padding) and the silu activation: the training path's outputs and final state equal
    the no-gradient path's bit for bit."""
    x = torch.randn(2, 7, 4, requires_grad=True)
    weight = torch.randn(4, 3, requires_grad=True)
    lengths = torch.tensor([7, 3])
    y, final = causal_conv1d(x, weight, lengths=lengths, activation="silu")
    with torch.no_grad():
        y_inference, final_inference = causal_conv1d(x, weight, lengths=lengths, activation="silu")
    assert torch.equal(y, y_inference) and torch.equal(final, final_inference)
    assert y.requires_grad and y.grad_fn is not None


@pytest.mark.parametrize("lengths", [None, [1, 0, 1]], ids=["full", "padded"])
@pytest.mark.parametrize("seq_len", [1, 3])
def test_in_place_writes_the_final_state_into_the_initial_one(seq_len, lengths):
    """``in_place`` (a static cache's history): the final state is written into ``initial_state``, which is
    returned, equal to the new state the call gives otherwise; one of another dtype is left alone."""
    x, weight = torch.randn(3, seq_len, 5), torch.randn(5, 4)
    lengths = None if lengths is None else torch.tensor(lengths)
    state = torch.randn(3, 3, 5)
    y_ref, final_ref = causal_conv1d(x, weight, state.clone(), lengths, "silu")
    given = state.clone()
    y, final = causal_conv1d(x, weight, given, lengths, "silu", in_place=True)
    assert final is given and torch.equal(final, final_ref) and torch.equal(y, y_ref)
    wide = state.double()
    assert causal_conv1d(x, weight, wide, lengths, in_place=True)[1] is not wide and torch.equal(wide, state.double())
