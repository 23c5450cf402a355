"""The pure-PyTorch gated delta rule ops against flash-linear-attention's per-token reference.

The oracle, ``fla.ops.gated_delta_rule.naive.naive_recurrent_gated_delta_rule``, runs the recurrence token by
token in float32 (it casts its inputs to float32 itself, as our ops do), so the tolerances against it are
float32-level. Where float32 is the weaker oracle (strong decays, long inputs, β close to 2) the tests use
an independent float64 loop, ``reference_float64``, instead.
"""

from __future__ import annotations

import warnings
from functools import partial

import pytest
import torch
import torch.nn.functional as F

with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)  # fla warns that Triton does not run on the CPU
    # The oracle is part of the `test` extra: a missing fla is an error, not a skip.
    from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule

from selective_rope.kernels import gated_delta_torch
from selective_rope.kernels.gated_delta_torch import (
    chunk_gated_delta_rule,
    recurrent_gated_delta_rule,
)

B, H, K, V = 2, 2, 16, 8
FP32_TOL = {"rtol": 1e-5, "atol": 1e-5}  # float32 math, different summation order
GRAD_TOL = {"rtol": 1e-4, "atol": 1e-4}  # gradients sum over the whole sequence


def make_inputs(seq_len: int, dtype=torch.float32, g=None, beta_max: float = 2.0):
    """Unit q, k (B, T, H, K), v (B, T, H, V), g <= 0 and β in (0, beta_max) (B, T, H), a state (B, H, K, V)."""
    q = F.normalize(torch.randn(B, seq_len, H, K), dim=-1)
    k = F.normalize(torch.randn(B, seq_len, H, K), dim=-1)
    v = torch.randn(B, seq_len, H, V)
    if g is None:  # decays from about exp(-3) to about 1
        g = F.logsigmoid(torch.randn(B, seq_len, H) + 2)
    beta = beta_max * torch.rand(B, seq_len, H)
    h0 = torch.randn(B, H, K, V)
    return q.to(dtype), k.to(dtype), v.to(dtype), g.to(dtype), beta.to(dtype), h0.to(dtype)


def chunk_with_state(chunk_size: int = 16):
    """chunk_gated_delta_rule as (q, k, v, g, beta, h0) -> (o, final state)."""
    return lambda q, k, v, g, beta, h0: chunk_gated_delta_rule(
        q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=chunk_size
    )


def recurrent_with_state(q, k, v, g, beta, h0):
    return recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True)


def naive_with_state(q, k, v, g, beta, h0):
    # fla's naive reference takes beta before g
    return naive_recurrent_gated_delta_rule(q, k, v, beta, g, initial_state=h0, output_final_state=True)


def reference_float64(q, k, v, g, beta, h0=None, scale=None):
    """The recurrence in float64, written independently: S_t = e^g S + β k (v - Sᵀk)ᵀ, o_t = S_tᵀ q_t scale."""
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    state = torch.zeros(B, H, K, V, dtype=torch.float64) if h0 is None else h0.double()
    outputs = []
    for t in range(q.shape[1]):
        state = g[:, t, :, None, None].exp() * state
        predicted = torch.einsum("bhk,bhkv->bhv", k[:, t], state)
        state = state + beta[:, t, :, None, None] * k[:, t, :, :, None] * (v[:, t] - predicted)[:, :, None, :]
        outputs.append(torch.einsum("bhk,bhkv->bhv", q[:, t] * scale, state))
    return torch.stack(outputs, dim=1), state


def assert_same_gradients(op, reference, q, k, v, g, beta, h0):
    """dq, dk, dv, dg, dβ and dh0 of op equal those of reference, for random upstream gradients on o and the state."""
    do, dht = torch.randn(B, q.shape[1], H, V), torch.randn(B, H, K, V)

    def grads(fn):
        leaves = [x.detach().requires_grad_() for x in (q, k, v, g, beta, h0)]
        o, ht = fn(*leaves)
        ((o * do).sum() + (ht * dht).sum()).backward()
        return [x.grad for x in leaves]

    names = ["dq", "dk", "dv", "dg", "dbeta", "dh0"]
    for name, grad, grad_ref in zip(names, grads(op), grads(reference)):
        assert grad is not None and torch.isfinite(grad).all(), name
        assert grad.abs().max() > 0, name  # every input really reaches the outputs
        torch.testing.assert_close(grad, grad_ref, **GRAD_TOL, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("seq_len", [1, 7, 16, 33])
@pytest.mark.parametrize("with_h0", [False, True], ids=["no_h0", "h0"])
def test_chunk_matches_naive(seq_len, with_h0):
    q, k, v, g, beta, h0 = make_inputs(seq_len)
    h0 = h0 if with_h0 else None
    inputs = [x.clone() for x in (q, k, v, g, beta) + ((h0,) if with_h0 else ())]
    o, ht = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=16)
    o_ref, ht_ref = naive_with_state(q, k, v, g, beta, h0)
    assert o.shape == (B, seq_len, H, V) and ht.shape == (B, H, K, V)
    assert o.dtype == ht.dtype == torch.float32 and o.is_contiguous()
    assert all(torch.equal(x, y) for x, y in zip(inputs, (q, k, v, g, beta, h0)))  # nothing changed in place
    torch.testing.assert_close(o, o_ref, **FP32_TOL)
    torch.testing.assert_close(ht, ht_ref, **FP32_TOL)


def test_chunk_default_chunk_size_and_no_final_state():
    q, k, v, g, beta, h0 = make_inputs(150)
    o, ht = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0)  # chunk_size=64: 2 full chunks, 1 partial
    assert ht is None
    torch.testing.assert_close(o, naive_with_state(q, k, v, g, beta, h0)[0], **FP32_TOL)


@pytest.mark.parametrize("chunks_per_segment", [1, 3])
def test_chunk_in_segments_matches_naive(monkeypatch, chunks_per_segment):
    # long inputs run as consecutive segments carrying the state; make the segments short enough to see here
    monkeypatch.setattr(gated_delta_torch, "SEGMENT_ELEMENTS", chunks_per_segment * B * H * 16 * K)
    q, k, v, g, beta, h0 = make_inputs(75)  # several segments of 16-token chunks, the last one 11 tokens long
    o, ht = chunk_with_state(16)(q, k, v, g, beta, h0)
    o_ref, ht_ref = naive_with_state(q, k, v, g, beta, h0)
    torch.testing.assert_close(o, o_ref, **FP32_TOL)
    torch.testing.assert_close(ht, ht_ref, **FP32_TOL)
    assert_same_gradients(chunk_with_state(16), naive_with_state, q, k, v, g, beta, h0)


def test_chunk_rejects_bad_chunk_size():
    q, k, v, g, beta, _ = make_inputs(8)
    with pytest.raises(ValueError, match="power of two"):
        chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=24)


@pytest.mark.parametrize("seq_len,chunk_size", [(7, 16), (40, 16), (70, 64)])
def test_chunk_gradients_match_naive(seq_len, chunk_size):
    assert_same_gradients(chunk_with_state(chunk_size), naive_with_state, *make_inputs(seq_len))


def test_recurrent_gradients_match_naive():
    assert_same_gradients(recurrent_with_state, naive_with_state, *make_inputs(9))


@pytest.mark.parametrize("seq_len", [1, 7, 33])
@pytest.mark.parametrize("with_h0", [False, True], ids=["no_h0", "h0"])
def test_recurrent_matches_naive(seq_len, with_h0):
    q, k, v, g, beta, h0 = make_inputs(seq_len)
    h0 = h0 if with_h0 else None
    o, ht = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o_ref, ht_ref = naive_with_state(q, k, v, g, beta, h0)
    assert o.shape == (B, seq_len, H, V) and ht.dtype == torch.float32
    torch.testing.assert_close(o, o_ref, **FP32_TOL)
    torch.testing.assert_close(ht, ht_ref, **FP32_TOL)
    assert recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0)[1] is None


@pytest.mark.parametrize("op", [partial(chunk_gated_delta_rule, chunk_size=16), recurrent_gated_delta_rule],
                         ids=["chunk", "recurrent"])
def test_explicit_scale(op):
    # the scale only multiplies q: scale s equals the default scale on q * s / K ** -0.5
    q, k, v, g, beta, h0 = make_inputs(40)
    o, ht = op(q, k, v, g, beta, scale=0.3, initial_state=h0, output_final_state=True)
    o_ref, ht_ref = naive_with_state(q * 0.3 * K**0.5, k, v, g, beta, h0)
    torch.testing.assert_close(o, o_ref, **FP32_TOL)
    torch.testing.assert_close(ht, ht_ref, **FP32_TOL)


@pytest.mark.parametrize("prefix_len", [1, 16, 21])
def test_chunk_prefill_then_recurrent_decode_matches_full_chunk(prefix_len):
    q, k, v, g, beta, h0 = make_inputs(prefix_len + 5)
    o_full, ht_full = chunk_with_state(16)(q, k, v, g, beta, h0)

    head = slice(0, prefix_len)
    o_prefill, state = chunk_with_state(16)(q[:, head], k[:, head], v[:, head], g[:, head], beta[:, head], h0)
    outputs = [o_prefill]
    for t in range(prefix_len, prefix_len + 5):  # decoding: one token per call
        step = slice(t, t + 1)
        o_t, state = recurrent_with_state(q[:, step], k[:, step], v[:, step], g[:, step], beta[:, step], state)
        outputs.append(o_t)
    torch.testing.assert_close(torch.cat(outputs, dim=1), o_full, **FP32_TOL)
    torch.testing.assert_close(state, ht_full, **FP32_TOL)
    torch.testing.assert_close(o_full, naive_with_state(q, k, v, g, beta, h0)[0], **FP32_TOL)


@pytest.mark.parametrize("op", [chunk_with_state(16), recurrent_with_state], ids=["chunk", "recurrent"])
@pytest.mark.parametrize("length", [5, 16, 20])
def test_padding_leaves_state_exactly_unchanged(op, length):
    # the caller's convention: β = 0 and g = 0 at pads (q, k, v arbitrary). The state must pass them bit for bit,
    # here over the rest of a chunk and over a whole further chunk of pads (seq_len 40, chunks of 16).
    q, k, v, g, beta, h0 = make_inputs(40)
    beta[:, length:], g[:, length:] = 0, 0
    _, ht = op(q, k, v, g, beta, h0)
    real = slice(0, length)
    _, ht_unpadded = op(q[:, real], k[:, real], v[:, real], g[:, real], beta[:, real], h0)
    assert torch.equal(ht, ht_unpadded)


def test_padding_in_a_batch_matches_each_row_alone():
    # right padding in a batch: each row's final state is that of the row alone (chunk path), to float32 rounding
    lengths = [11, 40]
    q, k, v, g, beta, h0 = make_inputs(40)
    for row, length in enumerate(lengths):
        beta[row, length:], g[row, length:] = 0, 0
    _, ht = chunk_with_state(16)(q, k, v, g, beta, h0)
    for row, length in enumerate(lengths):
        alone = [x[row : row + 1, :length] for x in (q, k, v, g, beta)]
        _, ht_row = chunk_gated_delta_rule(*alone, initial_state=h0[row : row + 1], output_final_state=True,
                                           chunk_size=16)
        torch.testing.assert_close(ht[row : row + 1], ht_row, **FP32_TOL)


def test_zero_beta_and_decay_is_the_identity_step():
    # β = 0 and g = 0 everywhere: nothing is written, nothing decays, and o_t = S_0ᵀ q_t scale exactly
    q, k, v, g, beta, h0 = make_inputs(20)
    for op in (chunk_with_state(16), recurrent_with_state):
        o, ht = op(q, k, v, torch.zeros_like(g), torch.zeros_like(beta), h0)
        assert torch.equal(ht, h0)
        torch.testing.assert_close(o, torch.einsum("bthk,bhkv->bthv", q * K**-0.5, h0), **FP32_TOL)


def long_strong_decay(seq_len: int) -> torch.Tensor:
    """g in [-20, -5] on about a third of the steps, in [-1e-2, 0] (almost no decay) on the others."""
    strong = torch.rand(B, seq_len, H) < 1 / 3
    return torch.where(strong, -5 - 15 * torch.rand(B, seq_len, H), -1e-2 * torch.rand(B, seq_len, H))


def test_long_strongly_decaying_sequence_is_finite_and_exact(monkeypatch):
    monkeypatch.setattr(gated_delta_torch, "SEGMENT_ELEMENTS", 4 * B * H * 64 * K)  # segments of 4 chunks
    seq_len = 1200  # 19 chunks of 64 (the last one partial), in 5 segments
    q, k, v, g, beta, h0 = make_inputs(seq_len, g=long_strong_decay(seq_len))
    o, ht = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    o_rec, ht_rec = recurrent_with_state(q, k, v, g, beta, h0)
    o_ref, ht_ref = reference_float64(q, k, v, g, beta, h0)
    torch.testing.assert_close(o, o_rec, **FP32_TOL)
    torch.testing.assert_close(ht, ht_rec, **FP32_TOL)
    torch.testing.assert_close(o.double(), o_ref, **FP32_TOL)
    torch.testing.assert_close(ht.double(), ht_ref, **FP32_TOL)


@pytest.mark.parametrize("reset", [-1e3, -1e5, float("-inf")])
def test_chunk_small_decays_after_a_hard_reset_are_exact(reset):
    # a huge log decay mid-chunk, then tiny ones: the cumulative log decay is large, the decays after it are not.
    # In float32, cum - cum would lose those small decays to cancellation (errors ~1e-3 here); g = -inf must not
    # give nan (inf - inf).
    q, k, v, _, beta, h0 = make_inputs(64)
    g = torch.full((B, 64, H), -1e-2)
    g[:, 10] = reset
    o, ht = chunk_with_state(64)(q, k, v, g, beta, h0)
    o_ref, ht_ref = reference_float64(q, k, v, g, beta, h0)
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    torch.testing.assert_close(o.double(), o_ref, **FP32_TOL)
    torch.testing.assert_close(ht.double(), ht_ref, **FP32_TOL)


@pytest.mark.parametrize("g_value", [-30.0, float("-inf")])
@pytest.mark.parametrize("op", [chunk_with_state(64), recurrent_with_state], ids=["chunk", "recurrent"])
def test_uniform_strong_decay_forgets_everything_but_the_current_token(op, g_value):
    # g = -30 (exp(-30) ~ 1e-13) or -inf: S_t = β_t k_t v_tᵀ, so o_t = β_t (q_t · k_t) scale v_t
    q, k, v, _, beta, h0 = make_inputs(130)
    o, ht = op(q, k, v, torch.full((B, 130, H), g_value), beta, h0)
    expected = (beta * (q * k).sum(-1) * K**-0.5)[..., None] * v
    torch.testing.assert_close(o, expected, **FP32_TOL)
    torch.testing.assert_close(ht, beta[:, -1, :, None, None] * k[:, -1, :, :, None] * v[:, -1, :, None, :],
                               **FP32_TOL)


def test_chunk_strong_decay_gradients_match_naive():
    seq_len = 40
    assert_same_gradients(chunk_with_state(16), naive_with_state, *make_inputs(seq_len, g=long_strong_decay(seq_len)))


def test_chunk_beta_near_two_with_near_parallel_keys():
    # the hardest case for the chunk form: nearly the same key again and again, no decay, β close to 2 (the state
    # flips sign along k at each step, 1 - β ~ -1), so the UT inverse has alternating O(1) entries and the
    # in-chunk sums cancel. Any chunked form loses digits here (about 1e-4 on O(1) values; transformers' does the
    # same); the per-token loop stays at float32 rounding.
    seq_len = 64
    q, _, v, _, _, h0 = make_inputs(seq_len)
    k = F.normalize(F.normalize(torch.randn(B, 1, H, K), dim=-1) + 1e-3 * torch.randn(B, seq_len, H, K), dim=-1)
    beta = 1.99 + 0.009 * torch.rand(B, seq_len, H)
    g = torch.zeros(B, seq_len, H)
    o_ref, ht_ref = reference_float64(q, k, v, g, beta, h0)
    o, ht = chunk_with_state(64)(q, k, v, g, beta, h0)
    torch.testing.assert_close(o.double(), o_ref, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(ht.double(), ht_ref, rtol=1e-3, atol=1e-3)
    o, ht = recurrent_with_state(q, k, v, g, beta, h0)
    torch.testing.assert_close(o.double(), o_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ht.double(), ht_ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("op", [chunk_with_state(16), recurrent_with_state], ids=["chunk", "recurrent"])
def test_bf16_inputs(op):
    q, k, v, g, beta, h0 = make_inputs(40, dtype=torch.bfloat16)
    o, ht = op(q, k, v, g, beta, h0)
    assert o.dtype == torch.bfloat16 and ht.dtype == torch.float32
    # the same bf16 values in float32: the math is float32 either way, only o is rounded to bf16
    o32, ht32 = op(*(x.float() for x in (q, k, v, g, beta, h0)))
    torch.testing.assert_close(o, o32.to(torch.bfloat16), rtol=0, atol=0)
    torch.testing.assert_close(ht, ht32, **FP32_TOL)
    o_ref, ht_ref = naive_with_state(q, k, v, g, beta, h0)
    torch.testing.assert_close(o.float(), o_ref.float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(ht, ht_ref, **FP32_TOL)


@pytest.mark.parametrize("op", [chunk_with_state(16), recurrent_with_state], ids=["chunk", "recurrent"])
def test_output_dtype_follows_v(op):
    # as fla's kernels: o comes back in v's dtype, whatever q and k are
    q, k, v, g, beta, h0 = make_inputs(20)
    o, _ = op(q.bfloat16(), k.bfloat16(), v, g, beta, h0)
    assert o.dtype == torch.float32
    o, _ = op(q, k, v.bfloat16(), g, beta, h0)
    assert o.dtype == torch.bfloat16


@pytest.mark.parametrize("seq_len", [1, 3])
def test_recurrent_in_place_updates_the_given_state(seq_len):
    """``in_place`` (a static cache's state): the final state is written into the initial state, which is returned,
    bit for bit what the step that returns a new state gives; a state it cannot write as it is (float64) is left
    alone, and a new one returned."""
    q, k, v, g, beta, h0 = make_inputs(seq_len)
    o_ref, ht_ref = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0.clone(), output_final_state=True)
    state = h0.clone()
    o, ht = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=state, output_final_state=True,
                                       in_place=True)
    assert ht is state and torch.equal(ht, ht_ref) and torch.equal(o, o_ref)
    wide = h0.double()
    ht = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=wide, output_final_state=True, in_place=True)[1]
    assert ht is not wide and torch.equal(wide, h0.double())
