"""The Triton Selective RoPE kernel (run on CPU by Triton's interpreter) against the PyTorch reference op."""

import importlib
import os

import pytest
import torch

if not torch.cuda.is_available():  # no GPU: the kernels run on CPU in Triton's interpreter
    os.environ["TRITON_INTERPRET"] = "1"

pytest.importorskip("triton", reason="triton is not installed: the Triton rotary kernel cannot be tested")

from selective_rope.kernels import rotary_triton  # noqa: E402
from selective_rope.kernels.rotary_torch import selective_rotary  # noqa: E402

# `@triton.jit` picks compiled or interpreted when the module is imported: re-import it in case something imported
# it before TRITON_INTERPRET was set above.
rotary_triton = importlib.reload(rotary_triton)
selective_rotary_triton = rotary_triton.selective_rotary_triton


def make_inputs(batch, seq_len, hq, hk, head_dim, half, dtype=torch.float32, init=True, increment_shape=None,
                temperature_grad=True):
    q = torch.randn(batch, seq_len, hq, head_dim, dtype=dtype, requires_grad=True)
    k = torch.randn(batch, seq_len, hk, head_dim, dtype=dtype, requires_grad=True)
    shape = increment_shape or (batch, seq_len, hk, half)
    increment = (0.5 * torch.randn(*shape)).requires_grad_()
    temperature = (0.5 + torch.rand(half)).requires_grad_(temperature_grad)
    phase0 = torch.randn(batch, hk, half, requires_grad=True) if init else None
    return q, k, increment, temperature, phase0


def grads(outputs, weights, inputs):
    loss = sum((out.float() * w).sum() for out, w in zip(outputs, weights))
    wanted = [x for x in inputs if x is not None and x.requires_grad]
    return torch.autograd.grad(loss, wanted)


def assert_close(actual, expected, name, rtol=1e-4, atol=1e-4):
    scale = max(expected.float().abs().max().item(), 1.0)
    torch.testing.assert_close(actual.float(), expected.float(), rtol=rtol, atol=atol * scale,
                               msg=lambda message: f"{name}: {message}")


def check(batch, seq_len, hq, hk, head_dim, half, dtype=torch.float32, init=True, increment_shape=None,
          temperature_grad=True):
    inputs = make_inputs(batch, seq_len, hq, hk, head_dim, half, dtype, init, increment_shape, temperature_grad)
    expected = selective_rotary(*inputs)
    actual = selective_rotary_triton(*inputs)
    for name, a, e in zip(("q", "k", "final_phase"), actual, expected):
        assert a.shape == e.shape and a.dtype == e.dtype, name
        if a.dtype == torch.bfloat16:  # same float32 math, rounded once: at most one bf16 step apart
            assert_close(a, e, name, rtol=1e-2, atol=1e-2)
        else:
            assert_close(a, e, name, rtol=1e-5, atol=1e-5)

    weights = [torch.randn(e.shape) for e in expected]  # the final phase's gradient is checked too
    names = [n for n, x in zip(("q", "k", "increment", "temperature", "initial_phase"), inputs)
             if x is not None and x.requires_grad]
    for name, a, e, x in zip(names, grads(actual, weights, inputs), grads(expected, weights, inputs),
                             [x for x in inputs if x is not None and x.requires_grad]):
        assert a.shape == x.shape and a.dtype == x.dtype, name
        assert_close(a, e, f"d{name}", rtol=1e-2 if dtype == torch.bfloat16 else 1e-4,
                     atol=1e-2 if dtype == torch.bfloat16 else 1e-4)


@pytest.mark.parametrize("seq_len", [1, 7, 33])
@pytest.mark.parametrize("init", [True, False], ids=["init", "no_init"])
def test_odd_lengths(seq_len, init):
    check(2, seq_len, 2, 2, 8, 4, init=init)


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_gqa(groups):
    check(1, 9, 2 * groups, 2, 8, 4)


@pytest.mark.parametrize("head_dim,half", [(10, 3), (12, 2), (7, 3), (6, 1)])
def test_partial_rotation(head_dim, half):
    check(2, 7, 4, 2, head_dim, half)


def test_long_sequence_spans_several_time_tiles():
    assert rotary_triton._config(4, 0)["BLOCK_T"] <= 16  # so 70 tokens are >= 5 tiles
    check(1, 70, 2, 1, 8, 4)


def test_rope_broadcast_increment():
    """RoPE: increment ``(B, T, 1, 1)`` of ones, its gradient reduced back to that shape."""
    check(2, 11, 4, 2, 8, 4, init=False, increment_shape=(2, 11, 1, 1))
    check(1, 5, 2, 2, 6, 3, increment_shape=(1, 5, 2, 1), temperature_grad=False)


def test_rope_matches_positions():
    seq_len, half = 9, 4
    q, k = torch.randn(1, seq_len, 2, 8), torch.randn(1, seq_len, 1, 8)
    tau = 10000.0 ** (-torch.arange(half, dtype=torch.float32) / half)
    out_q, out_k, final = selective_rotary_triton(q, k, torch.ones(1, seq_len, 1, 1), tau)
    angle = (torch.arange(1, seq_len + 1, dtype=torch.float32)[:, None] * tau)[None, :, None]
    cos, sin = angle.cos(), angle.sin()
    x1, x2 = k[..., :half], k[..., half:]
    torch.testing.assert_close(out_k, torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1))
    torch.testing.assert_close(final, torch.full((1, 1, half), float(seq_len)))


def test_bf16_inputs():
    check(2, 13, 4, 2, 10, 4, dtype=torch.bfloat16)


def test_no_temperature_grad_and_frozen_initial_phase():
    q, k, increment, temperature, phase0 = make_inputs(1, 6, 2, 1, 8, 4, temperature_grad=False)
    phase0.requires_grad_(False)
    out = selective_rotary_triton(q, k, increment, temperature, phase0)
    ref = selective_rotary(q, k, increment, temperature, phase0)
    weights = [torch.randn(r.shape) for r in ref]
    for a, e in zip(grads(out, weights, (q, k, increment)), grads(ref, weights, (q, k, increment))):
        assert_close(a, e, "grad")


def test_several_frequency_and_pass_through_blocks(monkeypatch):
    """Tiny blocks so that R spans 3 frequency programs and the pass-through dims 3 chunks."""
    base = rotary_triton._config
    monkeypatch.setattr(rotary_triton, "_config",
                        lambda r, p: {**base(r, p), "BLOCK_T": 4, "BLOCK_R": 2, "BLOCK_P": 2})
    check(1, 9, 4, 2, 16, 5)


def test_non_contiguous_inputs():
    q = torch.randn(1, 2, 5, 8).transpose(1, 2).requires_grad_()  # (B, T, H, D) view with odd strides
    k = torch.randn(1, 1, 5, 8).permute(0, 2, 1, 3).requires_grad_()
    increment = torch.randn(1, 5, 1, 4)
    tau = torch.rand(4)
    for a, e in zip(selective_rotary_triton(q, k, increment, tau), selective_rotary(q, k, increment, tau)):
        assert_close(a, e, "out", rtol=1e-5, atol=1e-5)


def test_empty_sequence():
    q, k = torch.randn(2, 0, 2, 8), torch.randn(2, 0, 1, 8)
    phase0 = torch.randn(2, 1, 4)
    out_q, out_k, final = selective_rotary_triton(q, k, torch.zeros(2, 0, 1, 4), torch.rand(4), phase0)
    assert out_q.shape == q.shape and out_k.shape == k.shape
    torch.testing.assert_close(final, phase0)


@pytest.mark.parametrize("init", [True, False], ids=["init", "no_init"])
def test_packed_sequences(init):
    """cu_seqlens: the phase restarts at each boundary; equal to running each sequence on its own."""
    lengths = [5, 1, 17, 0, 8]
    offsets = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    total, hq, hk, head_dim, half = sum(lengths), 4, 2, 10, 3
    q = torch.randn(1, total, hq, head_dim, requires_grad=True)
    k = torch.randn(1, total, hk, head_dim, requires_grad=True)
    increment = torch.randn(1, total, hk, half, requires_grad=True)
    temperature = torch.rand(half, requires_grad=True)
    phase0 = torch.randn(len(lengths), hk, half, requires_grad=True) if init else None

    actual = selective_rotary_triton(q, k, increment, temperature, phase0, cu_seqlens=offsets)
    pieces = [selective_rotary(q[:, s:e], k[:, s:e], increment[:, s:e], temperature,
                               None if phase0 is None else phase0[i:i + 1])
              for i, (s, e) in enumerate(zip(offsets[:-1].tolist(), offsets[1:].tolist()))]
    expected = (torch.cat([p[0] for p in pieces], 1), torch.cat([p[1] for p in pieces], 1),
                torch.cat([p[2] for p in pieces], 0))
    for name, a, e in zip(("q", "k", "final_phase"), actual, expected):
        assert a.shape == e.shape, name
        assert_close(a, e, name, rtol=1e-5, atol=1e-5)
    inputs = (q, k, increment, temperature, phase0)
    weights = [torch.randn(e.shape) for e in expected]
    for a, e in zip(grads(actual, weights, inputs), grads(expected, weights, inputs)):
        assert_close(a, e, "grad")


def test_detects_a_wrong_phase():
    """The comparison is sharp: the reference with a one-token shift of the phase is rejected."""
    q, k, increment, temperature, _ = make_inputs(1, 8, 2, 1, 8, 4, init=False)
    out_k = selective_rotary_triton(q, k, increment, temperature)[1]
    shifted = torch.cat([torch.zeros_like(increment[:, :1]), increment[:, :-1]], 1)
    with pytest.raises(AssertionError):
        assert_close(out_k, selective_rotary(q, k, shifted, temperature)[1], "k")


@pytest.mark.slow
def test_larger_shapes():
    check(2, 300, 8, 2, 64, 16)
    check(1, 257, 4, 4, 128, 64, dtype=torch.bfloat16)
