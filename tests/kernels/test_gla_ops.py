"""The pure-PyTorch GLA ops against flash-linear-attention's per-token reference.

The oracle, ``fla.ops.gla.naive.naive_recurrent_gla``, runs the recurrence token by token in float32
(it casts its inputs to float32 itself, as our ops do, even float64 ones), so the tolerances below are
float32-level.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)  # fla warns that Triton does not run on the CPU
    # The oracle is part of the `test` extra: a missing fla is an error, not a skip.
    from fla.ops.gla.naive import naive_recurrent_gla

from selective_rope.kernels import gla_torch
from selective_rope.kernels.gla_torch import chunk_gla, recurrent_gla

B, H, K, V = 2, 2, 16, 8
FP32_TOL = dict(rtol=1e-5, atol=1e-5)  # float32 math, different summation order
GRAD_TOL = dict(rtol=1e-4, atol=1e-4)  # gradients sum over the whole sequence


def make_inputs(seq_len: int, dtype=torch.float32, gk=None):
    """Random q, k (B, T, H, K), v (B, T, H, V), a log decay gk <= 0 and an initial state (B, H, K, V)."""
    q = torch.randn(B, seq_len, H, K, dtype=dtype)
    k = torch.randn(B, seq_len, H, K, dtype=dtype)
    v = torch.randn(B, seq_len, H, V, dtype=dtype)
    if gk is None:  # decays from about exp(-3) to about 1
        gk = F.logsigmoid(torch.randn(B, seq_len, H, K) + 2)
    h0 = torch.randn(B, H, K, V, dtype=dtype)
    return q, k, v, gk.to(dtype), h0


def mixed_strong_decay(seq_len: int) -> torch.Tensor:
    """gk in [-40, -5] on half of the key dims, in [-1e-3, 0] (almost no decay) on the others."""
    strong = -5 - 35 * torch.rand(B, seq_len, H, K)
    weak = -1e-3 * torch.rand(B, seq_len, H, K)
    return torch.where(torch.arange(K) % 2 == 0, strong, weak)


def chunk_with_state(chunk_size: int):
    """chunk_gla as (q, k, v, gk, h0) -> (o, final state)."""
    return lambda q, k, v, gk, h0: chunk_gla(q, k, v, gk, initial_state=h0, output_final_state=True,
                                             chunk_size=chunk_size)


def naive_with_state(q, k, v, gk, h0):
    return naive_recurrent_gla(q, k, v, gk, initial_state=h0, output_final_state=True)


def assert_same_gradients(op, q, k, v, gk, h0):
    """dq, dk, dv, dgk and dh0 of op equal those of naive, for random upstream gradients on o and the state."""
    do, dht = torch.randn(B, q.shape[1], H, V), torch.randn(B, H, K, V)

    def grads(fn):
        leaves = [x.detach().requires_grad_() for x in (q, k, v, gk, h0)]
        o, ht = fn(*leaves)
        ((o * do).sum() + (ht * dht).sum()).backward()
        return [x.grad for x in leaves]

    for name, grad, grad_ref in zip(["dq", "dk", "dv", "dgk", "dh0"], grads(op), grads(naive_with_state)):
        assert torch.isfinite(grad).all(), name
        torch.testing.assert_close(grad, grad_ref, **GRAD_TOL, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("chunk_size", [16, 32])
@pytest.mark.parametrize("seq_len", [1, 5, 16, 64, 100, 130])
@pytest.mark.parametrize("with_h0", [False, True], ids=["no_h0", "h0"])
def test_chunk_matches_naive(seq_len, chunk_size, with_h0):
    q, k, v, gk, h0 = make_inputs(seq_len)
    h0 = h0 if with_h0 else None
    o, ht = chunk_gla(q, k, v, gk, initial_state=h0, output_final_state=True, chunk_size=chunk_size)
    o_ref, ht_ref = naive_recurrent_gla(q, k, v, gk, initial_state=h0, output_final_state=True)
    assert o.shape == (B, seq_len, H, V) and ht.shape == (B, H, K, V)
    torch.testing.assert_close(o, o_ref, **FP32_TOL)
    torch.testing.assert_close(ht, ht_ref, **FP32_TOL)


def test_chunk_default_chunk_size_and_no_final_state():
    q, k, v, gk, h0 = make_inputs(200)
    o, ht = chunk_gla(q, k, v, gk, initial_state=h0)  # chunk_size=64: 3 full chunks and a partial one
    assert ht is None
    torch.testing.assert_close(o, naive_recurrent_gla(q, k, v, gk, initial_state=h0)[0], **FP32_TOL)


@pytest.mark.parametrize("chunks_per_segment", [1, 3])
def test_chunk_in_segments_matches_naive(monkeypatch, chunks_per_segment):
    # long inputs run as consecutive segments carrying the state; make the segments short enough to see here
    monkeypatch.setattr(gla_torch, "SEGMENT_ELEMENTS", chunks_per_segment * B * H * 16 * K)
    q, k, v, gk, h0 = make_inputs(130)  # several segments of 16-token chunks, the last one 2 tokens long
    o, ht = chunk_with_state(16)(q, k, v, gk, h0)
    o_ref, ht_ref = naive_with_state(q, k, v, gk, h0)
    torch.testing.assert_close(o, o_ref, **FP32_TOL)
    torch.testing.assert_close(ht, ht_ref, **FP32_TOL)
    assert_same_gradients(chunk_with_state(16), q, k, v, gk, h0)


def test_chunk_rejects_bad_chunk_size():
    q, k, v, gk, _ = make_inputs(8)
    with pytest.raises(ValueError, match="power of two"):
        chunk_gla(q, k, v, gk, chunk_size=24)


@pytest.mark.parametrize("seq_len,strong", [(5, False), (64, False), (100, False), (70, True)])
def test_chunk_gradients_match_naive(seq_len, strong):
    q, k, v, gk, h0 = make_inputs(seq_len, gk=mixed_strong_decay(seq_len) if strong else None)
    assert_same_gradients(chunk_with_state(16), q, k, v, gk, h0)


@pytest.mark.parametrize("seq_len", [1, 7, 33])
@pytest.mark.parametrize("with_h0", [False, True], ids=["no_h0", "h0"])
def test_recurrent_matches_naive(seq_len, with_h0):
    q, k, v, gk, h0 = make_inputs(seq_len)
    h0 = h0 if with_h0 else None
    o, ht = recurrent_gla(q, k, v, gk, initial_state=h0, output_final_state=True)
    o_ref, ht_ref = naive_recurrent_gla(q, k, v, gk, initial_state=h0, output_final_state=True)
    torch.testing.assert_close(o, o_ref, **FP32_TOL)
    torch.testing.assert_close(ht, ht_ref, **FP32_TOL)
    assert recurrent_gla(q, k, v, gk, initial_state=h0)[1] is None


@pytest.mark.parametrize("op", [chunk_gla, recurrent_gla], ids=["chunk", "recurrent"])
def test_explicit_scale(op):
    # naive fixes scale = K ** -0.5, so a scale s equals naive on q * s / K ** -0.5
    q, k, v, gk, h0 = make_inputs(40)
    o, ht = op(q, k, v, gk, scale=0.3, initial_state=h0, output_final_state=True)
    o_ref, ht_ref = naive_with_state(q * 0.3 * K**0.5, k, v, gk, h0)
    torch.testing.assert_close(o, o_ref, **FP32_TOL)
    torch.testing.assert_close(ht, ht_ref, **FP32_TOL)


@pytest.mark.parametrize("seq_len", [2, 17, 65, 130])
def test_prefill_then_decode_matches_full_run(seq_len):
    q, k, v, gk, h0 = make_inputs(seq_len)
    o_ref, ht_ref = naive_with_state(q, k, v, gk, h0)

    o_prefill, state = chunk_with_state(16)(q[:, :-1], k[:, :-1], v[:, :-1], gk[:, :-1], h0)
    o_last, ht = recurrent_gla(q[:, -1:], k[:, -1:], v[:, -1:], gk[:, -1:], initial_state=state,
                               output_final_state=True)
    torch.testing.assert_close(o_prefill, o_ref[:, :-1], **FP32_TOL)
    torch.testing.assert_close(o_last, o_ref[:, -1:], **FP32_TOL)
    torch.testing.assert_close(ht, ht_ref, **FP32_TOL)


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_chunk_strong_decay_is_finite_and_exact(chunk_size):
    # float64 inputs; both ops compute in float32, so the tolerance stays float32-level
    q, k, v, gk, h0 = make_inputs(150, dtype=torch.float64, gk=mixed_strong_decay(150))
    o, ht = chunk_with_state(chunk_size)(q, k, v, gk, h0)
    o_ref, ht_ref = naive_with_state(q, k, v, gk, h0)
    assert o.dtype == torch.float64 and torch.isfinite(o).all() and torch.isfinite(ht).all()
    torch.testing.assert_close(o, o_ref, **FP32_TOL)
    torch.testing.assert_close(ht, ht_ref, **FP32_TOL)


def test_chunk_uniform_strong_decay_forgets_everything_but_the_current_token():
    # gk = -30 on every dim: exp(-30) ~ 1e-13, so o_t = (q_t . k_t) scale v_t up to ~1e-13
    q, k, v, _, h0 = make_inputs(130)
    gk = torch.full((B, 130, H, K), -30.0)
    o, ht = chunk_with_state(64)(q, k, v, gk, h0)
    torch.testing.assert_close(o, (q * k).sum(-1, keepdim=True) * K**-0.5 * v, **FP32_TOL)
    torch.testing.assert_close(ht, k[:, -1, :, :, None] * v[:, -1, :, None, :], **FP32_TOL)


@pytest.mark.parametrize("op", [chunk_gla, recurrent_gla], ids=["chunk", "recurrent"])
def test_bf16_inputs(op):
    q, k, v, gk, h0 = make_inputs(70, dtype=torch.bfloat16)
    o, ht = op(q, k, v, gk, initial_state=h0, output_final_state=True)
    assert o.dtype == torch.bfloat16 and ht.dtype == torch.float32
    # the same bf16 values in float32: the math is float32 either way, only o is rounded to bf16
    o32, ht32 = op(*(x.float() for x in (q, k, v, gk)), initial_state=h0.float(), output_final_state=True)
    torch.testing.assert_close(o, o32.to(torch.bfloat16), rtol=0, atol=0)
    torch.testing.assert_close(ht, ht32, **FP32_TOL)
    o_ref, ht_ref = naive_with_state(q, k, v, gk, h0)
    torch.testing.assert_close(o.float(), o_ref.float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(ht, ht_ref, **FP32_TOL)


@pytest.mark.parametrize("seq_len", [1, 3])
def test_recurrent_in_place_updates_the_given_state(seq_len):
    """``in_place`` (a static cache's state): the final state is written into the initial state, which is returned,
    bit for bit what the step that returns a new state gives; a state it cannot write as it is (float64) is left
    alone, and a new one returned."""
    q, k, v, gk, h0 = make_inputs(seq_len)
    o_ref, ht_ref = recurrent_gla(q, k, v, gk, initial_state=h0.clone(), output_final_state=True)
    state = h0.clone()
    o, ht = recurrent_gla(q, k, v, gk, initial_state=state, output_final_state=True, in_place=True)
    assert ht is state and torch.equal(ht, ht_ref) and torch.equal(o, o_ref)
    wide = h0.double()
    assert recurrent_gla(q, k, v, gk, initial_state=wide, output_final_state=True, in_place=True)[1] is not wide
    assert torch.equal(wide, h0.double())
