"""The pure-PyTorch forgetting attention op against flash-linear-attention's reference and a float64 one.

Two oracles:

* ``fla.ops.forgetting_attn.naive.naive_forgetting_attn``: the full (T x T) float32 computation with a
  global float32 cumulative sum of the gates; full sequences only (Tq == Tk), no padding.
* ``reference``, written here: the same full computation in float64, with queries at the end of the key
  timeline and padded keys; it is exact to float32 resolution where the float32 oracle is not (its global
  cumulative sum loses digits as it grows).

The op runs ``scaled_dot_product_attention`` per block when no gradient is needed and its own blockwise
autograd Function (explicit matmul + softmax, hand-written backward) when one is; the tests exercise both
(``torch.no_grad`` vs. leaves that require grad).
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
import torch.nn.functional as F

with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)  # fla warns that Triton does not run on the CPU
    # The oracle is part of the `test` extra: a missing fla is an error, not a skip.
    from fla.ops.forgetting_attn.naive import naive_forgetting_attn

from selective_rope.kernels import forgetting_attention_torch
from selective_rope.kernels.forgetting_attention_torch import forgetting_attention, forgetting_attention_with_weights

B, HQ, HK, D, DV = 2, 4, 2, 16, 8
FP32_TOL = {"rtol": 1e-5, "atol": 1e-5}  # float32 math, different summation order
GRAD_TOL = {"rtol": 1e-4, "atol": 1e-4}  # gradients sum over the whole sequence
EXACT_TOL = {"rtol": 2e-6, "atol": 2e-6}  # against the float64 reference


def make_inputs(seq_len, heads=(HQ, HK), dtype=torch.float32, gate_shift=2.0):
    """q (B, T, Hq, D), k (B, T, Hk, D), v (B, T, Hk, DV) and a log forget gate (B, T, Hq) in float32.

    The gate is logsigmoid(N(gate_shift, 1)): about -0.15 on average for the default shift.
    """
    hq, hk = heads
    q = torch.randn(B, seq_len, hq, D, dtype=dtype)
    k = torch.randn(B, seq_len, hk, D, dtype=dtype)
    v = torch.randn(B, seq_len, hk, DV, dtype=dtype)
    log_fgate = F.logsigmoid(torch.randn(B, seq_len, hq) + gate_shift)
    return q, k, v, log_fgate


def reference(q, k, v, log_fgate=None, scale=None, key_valid=None, rows=None, return_weights=False):
    """The definition, in float64, materialising everything; returns float64 (B, Tq, Hq, Dv), zeros at queries on
    padding slots (the op's convention, shared with the fla path).

    rows: evaluate only these query rows (indices into Tq), in that order. return_weights: also return the
    attention weights (B, Hq, rows, Tk).
    """
    _, tq, hq, d = q.shape
    tk, hk = k.shape[1], k.shape[2]
    scale = d**-0.5 if scale is None else scale
    q, k, v = (x.double() for x in (q, k, v))
    k, v = k.repeat_interleave(hq // hk, dim=2), v.repeat_interleave(hq // hk, dim=2)
    valid = torch.ones(q.shape[0], tk, dtype=torch.bool) if key_valid is None else key_valid
    gate = torch.zeros(q.shape[0], tk, hq, dtype=torch.float64) if log_fgate is None else log_fgate.double()
    c = (gate * valid[..., None]).cumsum(1).transpose(1, 2)  # (B, Hq, Tk)

    rows = torch.arange(tq) if rows is None else torch.as_tensor(rows)
    pos = tk - tq + rows  # key position of each query
    logits = torch.einsum("bihd,bjhd->bhij", q[:, rows], k) * scale + c[:, :, pos, None] - c[:, :, None, :]
    visible = (torch.arange(tk) <= pos[:, None]) & valid[:, None, None, :]  # (B, 1, rows, Tk)
    logits = logits.masked_fill(~visible, float("-inf"))
    probs = logits.softmax(-1).nan_to_num(0.0)  # a row with no visible key: zeros
    probs = probs * valid[:, None, pos, None]  # a query at a padding slot outputs zeros
    out = torch.einsum("bhij,bjhd->bihd", probs, v)
    return (out, probs) if return_weights else out


def grads(fn, inputs, do):
    """Gradients of (fn(*inputs) * do).sum() with respect to every input, computed on fresh leaves."""
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    (fn(*leaves) * do).sum().backward()
    return [x.grad for x in leaves]


def assert_close_all(actual, expected, names, **tol):
    for name, a, e in zip(names, actual, expected):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a, e.to(a.dtype), **tol, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa2", "mqa"])
@pytest.mark.parametrize("seq_len,block_size", [(1, None), (5, None), (64, 16), (100, 16), (100, 7)])
def test_matches_naive(seq_len, block_size, heads):
    q, k, v, g = make_inputs(seq_len, heads)
    with torch.no_grad():
        o = forgetting_attention(q, k, v, g, block_size=block_size)
    assert o.shape == (B, seq_len, heads[0], DV) and o.dtype == torch.float32 and o.is_contiguous()
    torch.testing.assert_close(o, naive_forgetting_attn(q, k, v, g), **FP32_TOL)
    torch.testing.assert_close(o, reference(q, k, v, g).float(), **EXACT_TOL)


@pytest.mark.parametrize("heads", [(4, 4), (4, 2)], ids=["mha", "gqa2"])
@pytest.mark.parametrize("seq_len,block_size", [(1, None), (50, None), (50, 16), (37, 5)])
def test_gradients_match_naive(seq_len, block_size, heads):
    q, k, v, g = make_inputs(seq_len, heads)
    do = torch.randn(B, seq_len, heads[0], DV)
    ours = grads(functools.partial(forgetting_attention, block_size=block_size), (q, k, v, g), do)
    assert_close_all(ours, grads(naive_forgetting_attn, (q, k, v, g), do), ["dq", "dk", "dv", "dg"], **GRAD_TOL)


def test_autograd_forward_equals_inference_forward():
    # the two paths (the explicit blockwise autograd Function vs. scaled_dot_product_attention blocks) agree
    q, k, v, g = make_inputs(70)
    valid = torch.rand(B, 70) > 0.2
    for kwargs in [{}, {"key_valid": valid}, {"block_size": 9, "key_valid": valid}]:
        with torch.no_grad():
            o_inference = forgetting_attention(q[:, 30:], k, v, g, **kwargs)
        o_autograd = forgetting_attention(q[:, 30:].requires_grad_(), k, v, g, **kwargs)
        assert o_autograd.requires_grad
        torch.testing.assert_close(o_autograd.detach(), o_inference, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("case", ["gate", "no_gate", "padded", "suffix", "padded_suffix"])
def test_gradients_match_float64_autograd(case):
    # the hand-written backward against autograd through the float64 definition, to float32 resolution
    q, k, v, g, valid = padded_inputs(45)
    kwargs = {"block_size": 8}
    if "padded" in case:
        kwargs["key_valid"] = valid
    if "suffix" in case:
        q = q[:, -13:]
    inputs = (q, k, v) if case == "no_gate" else (q, k, v, g)
    do = torch.randn(B, q.shape[1], HQ, DV)
    if "padded" in case:  # no upstream gradient on the queries that see no valid key
        do = do * (valid.cumsum(1)[:, -q.shape[1] :] > 0)[..., None, None]
    ours = grads(functools.partial(forgetting_attention, **kwargs), inputs, do)
    reference64 = functools.partial(reference, key_valid=kwargs.get("key_valid"))
    expected = grads(reference64, [x.double() for x in inputs], do.double())
    assert_close_all(ours, expected, ["dq", "dk", "dv", "dg"], rtol=1e-5, atol=1e-5)


def test_explicit_scale():
    # naive fixes scale = D ** -0.5, so a scale s equals naive on q * s / D ** -0.5
    q, k, v, g = make_inputs(30)
    with torch.no_grad():
        o = forgetting_attention(q, k, v, g, scale=0.3, block_size=8)
    torch.testing.assert_close(o, naive_forgetting_attn(q * 0.3 * D**0.5, k, v, g), **FP32_TOL)


@pytest.mark.parametrize("num_queries", [1, 7, 33])
@pytest.mark.parametrize("block_size", [None, 5])
def test_queries_at_the_end_of_the_key_timeline(num_queries, block_size):
    # a chunked prefill continuing a cache (or decoding, Tq = 1): the last Tq rows of the full computation
    q, k, v, g = make_inputs(40)
    with torch.no_grad():
        full = forgetting_attention(q, k, v, g)
        o = forgetting_attention(q[:, -num_queries:], k, v, g, block_size=block_size)
    assert o.shape == (B, num_queries, HQ, DV)
    torch.testing.assert_close(o, full[:, -num_queries:], **FP32_TOL)
    torch.testing.assert_close(o, reference(q[:, -num_queries:], k, v, g).float(), **EXACT_TOL)

    # gradients: those of the full computation with an upstream gradient on the last rows only
    do = torch.randn(B, num_queries, HQ, DV)
    op = functools.partial(forgetting_attention, block_size=block_size)
    ours = grads(op, (q[:, -num_queries:], k, v, g), do)
    full_do = F.pad(do, (0, 0, 0, 0, 40 - num_queries, 0))
    dq, dk, dv, dg = grads(naive_forgetting_attn, (q, k, v, g), full_do)
    assert_close_all(ours, [dq[:, -num_queries:], dk, dv, dg], ["dq", "dk", "dv", "dg"], **GRAD_TOL)


def record_sdpa_calls(monkeypatch):
    """Record (q, k, attn_mask) shapes of every scaled_dot_product_attention call."""
    calls = []
    sdpa = F.scaled_dot_product_attention

    def recording(q, k, v, attn_mask=None, **kwargs):
        calls.append((tuple(q.shape), tuple(k.shape), None if attn_mask is None else tuple(attn_mask.shape)))
        return sdpa(q, k, v, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    return calls


@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa2", "mqa"])
@pytest.mark.parametrize("gate", [True, False], ids=["gate", "no_gate"])
@pytest.mark.parametrize("padded", [False, True], ids=["full", "holes"])
@pytest.mark.parametrize("one_sdpa_call", [True, False], ids=["sdpa", "products"])
def test_decoding_step(monkeypatch, heads, gate, padded, one_sdpa_call):
    # one query per row, no blocks: one scaled_dot_product_attention call up to SDPA_SINGLE_QUERY_KEYS keys (here 300),
    # matrix products beyond (the threshold lowered to reach them)
    if not one_sdpa_call:
        monkeypatch.setattr(forgetting_attention_torch, "SDPA_SINGLE_QUERY_KEYS", 299)
    q, k, v, g, valid = padded_inputs(300, heads=heads)
    g, valid = (g if gate else None), (valid if padded else None)
    calls = record_sdpa_calls(monkeypatch)
    with torch.no_grad():
        o = forgetting_attention(q[:, -1:], k, v, g, key_valid=valid)
    masked = gate or padded
    expected_calls = [((B, heads[0], 1, D), (B, heads[1], 300, D), (B, heads[0] if gate else 1, 1, 300) if masked
                       else None)] if one_sdpa_call else []
    assert calls == expected_calls and o.shape == (B, 1, heads[0], DV)
    torch.testing.assert_close(o, reference(q[:, -1:], k, v, g, key_valid=valid).float(), **EXACT_TOL)


def record_flash_calls(monkeypatch):
    """Record (q, k, attn_mask, is_causal) shapes of every call of the merged path's CPU flash kernel."""
    calls = []
    flash = forgetting_attention_torch._CPU_FLASH

    def recording(q, k, v, dropout, is_causal, attn_mask=None, scale=None):
        calls.append((tuple(q.shape), tuple(k.shape), None if attn_mask is None else tuple(attn_mask.shape),
                      is_causal))
        return flash(q, k, v, dropout, is_causal, attn_mask=attn_mask, scale=scale)

    monkeypatch.setattr(forgetting_attention_torch, "_CPU_FLASH", recording)
    return calls


@pytest.mark.parametrize("heads", [(4, 4), (4, 2)], ids=["mha", "gqa2"])
@pytest.mark.parametrize("gate", [True, False], ids=["gate", "no_gate"])
@pytest.mark.parametrize("queries,block_size", [(190, 32), (200, 32), (200, 7), (64, 64), (3, 32), (200, 16)])
def test_merged_blocks_read_their_square_and_the_past_keys(monkeypatch, heads, gate, queries, block_size):
    # without padding: queries in outer blocks of MERGED_OUTER_BLOCKS blocks. Per block, one call on its own
    # (rows x rows) causal square and one on the keys of the outer block before it; per outer block, one call on the
    # keys before it for all its rows (key-only masks); merged by log-sum-exp. Lengths that are and are not multiples
    # of either block; every call reads keys before or at its rows only.
    q, k, v, g = make_inputs(200, heads)
    g = g if gate else None
    calls = record_flash_calls(monkeypatch)
    with torch.no_grad():
        o = forgetting_attention(q[:, -queries:], k, v, g, block_size=block_size)
    torch.testing.assert_close(o, reference(q[:, -queries:], k, v, g).float(), **EXACT_TOL)

    def past(rows, keys):
        return ((B, HQ, rows, D), (B, HQ, keys, D), (B, HQ, 1, keys) if gate else None, False)

    expected, outer = [], block_size * forgetting_attention_torch.MERGED_OUTER_BLOCKS
    for outer_first in range(200 - queries, 200, outer):
        outer_end = min(200, outer_first + outer)
        for first in range(outer_first, outer_end, block_size):
            rows = min(block_size, outer_end - first)
            expected.append(((B, HQ, rows, D), (B, HQ, rows, D), (B, HQ, rows, rows) if gate else None, not gate))
            if first > outer_first:
                expected.append(past(rows, first - outer_first))
        if outer_first:
            expected.append(past(outer_end - outer_first, outer_first))
    if not gate and queries == 200:  # a whole sequence without a gate is one causal scaled_dot_product_attention
        expected = []
    assert calls == expected


def test_merged_path_with_value_size_above_key_size():
    # the flash kernel takes one head size: q and k are padded with zero columns
    q, k, _, g = make_inputs(50)
    v = torch.randn(B, 50, HK, 2 * D)
    with torch.no_grad():
        o = forgetting_attention(q[:, 10:], k, v, g, block_size=16)
    torch.testing.assert_close(o, reference(q[:, 10:], k, v, g).float(), **EXACT_TOL)


@pytest.mark.parametrize("gate", [True, False], ids=["gate", "no_gate"])
def test_padded_blocks_are_bounded_and_read_only_past_keys(monkeypatch, gate):
    # with holes in the key timeline: one scaled_dot_product_attention per block, its mask a bounded tile
    monkeypatch.setattr(forgetting_attention_torch, "BLOCK_ELEMENTS", 32 * B * HQ * 200)  # 32 rows at Tk=200
    q, k, v, g, valid = padded_inputs(200)
    g = g if gate else None
    calls = record_sdpa_calls(monkeypatch)
    with torch.no_grad():
        o = forgetting_attention(q[:, 10:], k, v, g, key_valid=valid)
    torch.testing.assert_close(o, reference(q[:, 10:], k, v, g, key_valid=valid).float(), **EXACT_TOL)
    # 190 queries in blocks of 32 rows, each against the keys up to its last query only
    heads = HQ if gate else 1  # without a gate one mask serves every head
    assert calls == [((B, HQ, rows, D), (B, HK, first + rows, D), (B, heads, rows, first + rows))
                     for first in range(10, 200, 32) for rows in [min(32, 200 - first)]]


def test_merged_path_off_cpu_falls_back_to_masked_blocks(monkeypatch):
    # without the CPU flash kernel (other devices), unpadded timelines take the masked blocks as well
    q, k, v, g = make_inputs(90)
    monkeypatch.setattr(forgetting_attention_torch, "_CPU_FLASH", None)
    calls = record_sdpa_calls(monkeypatch)
    with torch.no_grad():
        o = forgetting_attention(q[:, 5:], k, v, g, block_size=32)
    assert len(calls) == 3
    torch.testing.assert_close(o, reference(q[:, 5:], k, v, g).float(), **EXACT_TOL)


def test_autograd_blocks_are_bounded_and_read_only_past_keys(monkeypatch):
    tiles = []  # (shape, address) of every block's probability tile, forward and backward
    block_probs = forgetting_attention_torch._block_probs

    def recording(*args):
        probs = block_probs(*args)
        tiles.append((tuple(probs.shape), probs.data_ptr()))
        return probs

    monkeypatch.setattr(forgetting_attention_torch, "_block_probs", recording)
    q, k, v, g = make_inputs(50)
    o = forgetting_attention(q[:, 10:].requires_grad_(), k, v, g, block_size=16)
    o.sum().backward()
    # grouped heads: (B * Hk, G * rows, keys up to the block's last query), once forward, once backward
    shapes = [(B * HK, 2 * 16, 26), (B * HK, 2 * 16, 42), (B * HK, 2 * 8, 50)]
    assert [shape for shape, _ in tiles] == shapes * 2
    # every block's tile lives in the same scratch buffer (one per pass)
    assert len({address for _, address in tiles[:3]}) == 1 and len({address for _, address in tiles[3:]}) == 1
    torch.testing.assert_close(o.detach(), reference(q[:, 10:], k, v, g).float(), **EXACT_TOL)


def padded_inputs(seq_len, gate_shift=2.0, heads=(HQ, HK)):
    """make_inputs plus a key_valid mask with holes everywhere (the first and last slots, runs of holes),
    batch row 0 left-padded (its first 4 queries see no valid key); invalid slots carry a garbage gate."""
    q, k, v, g = make_inputs(seq_len, heads, gate_shift=gate_shift)
    valid = torch.rand(B, seq_len) > 0.3
    valid[0, :4] = False
    valid[0, 4] = True
    valid[1, 0], valid[1, -1], valid[1, 5:9] = False, False, False
    g = torch.where(valid[..., None], g, torch.full_like(g, -50.0))  # must be ignored
    return q, k, v, g, valid


def test_key_holes_equal_the_sequence_without_them():
    q, k, v, g, valid = padded_inputs(60)
    # queries at padding positions output zeros (and pass no gradient back), whatever their upstream gradient
    do = torch.randn(B, 60, HQ, DV)
    with torch.no_grad():
        o = forgetting_attention(q, k, v, g, key_valid=valid, block_size=16)
    assert (o[~valid] == 0).all()
    op = functools.partial(forgetting_attention, key_valid=valid, block_size=16)
    dq, dk, dv, dg = grads(op, (q, k, v, g), do)
    for b in range(B):
        keep = valid[b]
        compact = [x[b : b + 1, keep] for x in (q, k, v, g)]
        o_ref = naive_forgetting_attn(*compact)
        torch.testing.assert_close(o[b : b + 1, keep], o_ref, **FP32_TOL)
        grads_ref = grads(naive_forgetting_attn, compact, do[b : b + 1, keep])
        ours = [x[b : b + 1, keep] for x in (dq, dk, dv, dg)]
        assert_close_all(ours, grads_ref, ["dq", "dk", "dv", "dg"], **GRAD_TOL)
        # nothing flows into padding keys (their gates included)
        for name, grad in [("dk", dk), ("dv", dv), ("dg", dg)]:
            assert (grad[b, ~keep] == 0).all(), name
    torch.testing.assert_close(o, reference(q, k, v, g, key_valid=valid).float(), **EXACT_TOL)


@pytest.mark.parametrize("autograd", [False, True], ids=["inference", "autograd"])
@pytest.mark.parametrize("gate", [True, False], ids=["gate", "no_gate"])
def test_queries_without_valid_keys_give_zeros_not_nan(autograd, gate):
    q, k, v, g, valid = padded_inputs(30)
    valid[1] = False  # batch row 1: nothing but padding
    g = g if gate else None
    inputs = [x for x in (q, k, v, g) if x is not None]
    op = functools.partial(forgetting_attention, key_valid=valid, block_size=8)
    if autograd:
        leaves = [x.clone().requires_grad_() for x in inputs]
        o = op(*leaves)
        o.square().sum().backward()
        for leaf in leaves:
            assert torch.isfinite(leaf.grad).all()
        assert (leaves[0].grad[0, :4] == 0).all() and (leaves[0].grad[1] == 0).all()
    else:
        with torch.no_grad():
            o = op(*inputs)
    assert torch.isfinite(o).all()
    assert (o[0, :4] == 0).all() and (o[1] == 0).all()
    torch.testing.assert_close(o.detach(), reference(q, k, v, g, key_valid=valid).float(), **EXACT_TOL)


def causal_softmax_attention(q, k, v):
    """Llama's eager attention in float32: softmax(q kᵀ scale + causal mask) v, k/v repeated to q's heads."""
    groups = q.shape[2] // k.shape[2]
    q, k, v = (x.transpose(1, 2) for x in (q, k.repeat_interleave(groups, 2), v.repeat_interleave(groups, 2)))
    t = q.shape[2]
    causal = torch.full((t, t), float("-inf")).triu(1)
    probs = (q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5 + causal).softmax(-1)
    return (probs @ v).transpose(1, 2)


@pytest.mark.parametrize("seq_len", [1, 33, 100])
def test_no_gate_is_plain_causal_softmax_attention(seq_len):
    q, k, v, _ = make_inputs(seq_len)
    expected = causal_softmax_attention(q, k, v)
    with torch.no_grad():
        o = forgetting_attention(q, k, v)
        sdpa = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)), is_causal=True,
                                              enable_gqa=True).transpose(1, 2)
        # the general blockwise path (queries at the end, all keys valid) computes the same thing
        everything_valid = torch.ones(B, seq_len, dtype=torch.bool)
        blockwise = forgetting_attention(q, k, v, key_valid=everything_valid, block_size=16)
        suffix = forgetting_attention(q[:, seq_len // 2 :], k, v, block_size=16)
    tol = {"rtol": 1e-6, "atol": 1e-6}
    assert o.is_contiguous()
    torch.testing.assert_close(o, expected, **tol)
    torch.testing.assert_close(o, sdpa, **tol)
    torch.testing.assert_close(blockwise, expected, **tol)
    torch.testing.assert_close(suffix, expected[:, seq_len // 2 :], **tol)

    do = torch.randn_like(o)
    for kwargs in [{}, {"key_valid": everything_valid, "block_size": 16}]:
        ours = grads(functools.partial(forgetting_attention, **kwargs), (q, k, v), do)
        assert_close_all(ours, grads(causal_softmax_attention, (q, k, v), do), ["dq", "dk", "dv"], **GRAD_TOL)


def long_strongly_forgetting_inputs():
    """T = 4096, Hq = 2, Hk = 1, log f uniform in [-5, -0.2] (about -2.6 per token)."""
    seq_len = 4096
    generator = torch.Generator().manual_seed(1)
    q = torch.randn(1, seq_len, 2, D, generator=generator)
    k = torch.randn(1, seq_len, 1, D, generator=generator)
    v = torch.randn(1, seq_len, 1, DV, generator=generator)
    g = -0.2 - 4.8 * torch.rand(1, seq_len, 2, generator=generator)
    assert g.sum(1).max() < -9000
    return q, k, v, g


# query rows checked against float64: both ends, block boundaries (block_size=64), the middle
LONG_ROWS = [0, 1, 63, 64, 1000, 2047, 3001, 4000, 4094, 4095]


def test_long_sequence_precision():
    # The cumulative gate reaches about -1e4 by the end, where a float32 ulp is ~1e-3, so a bias taken from
    # a global float32 cumulative sum would be off by ~1e-3 even between neighbouring tokens (which carry
    # most of the weight). Both paths, checked against float64 on a subset of query rows.
    q, k, v, g = long_strongly_forgetting_inputs()
    expected = reference(q, k, v, g, rows=LONG_ROWS).float()
    with torch.no_grad():
        o = forgetting_attention(q, k, v, g, block_size=64)
    torch.testing.assert_close(o[:, LONG_ROWS], expected, **EXACT_TOL)
    o = forgetting_attention(q.clone().requires_grad_(), k, v, g, block_size=64)
    torch.testing.assert_close(o[:, LONG_ROWS].detach(), expected, **EXACT_TOL)


def test_long_sequence_gradient_precision():
    # an upstream gradient on a subset of rows only, so that float64 autograd stays cheap
    q, k, v, g = long_strongly_forgetting_inputs()
    do_rows = torch.randn(1, len(LONG_ROWS), 2, DV)
    do = torch.zeros(1, 4096, 2, DV)
    do[:, LONG_ROWS] = do_rows
    ours = grads(functools.partial(forgetting_attention, block_size=64), (q, k, v, g), do)
    dq, dk, dv, dg = grads(functools.partial(reference, rows=LONG_ROWS), [x.double() for x in (q, k, v, g)],
                           do_rows.double())
    assert_close_all(ours, [dq, dk, dv, dg], ["dq", "dk", "dv", "dg"], rtol=5e-6, atol=5e-6)


@pytest.mark.parametrize("autograd", [False, True], ids=["inference", "autograd"])
def test_bf16_inputs(autograd):
    q, k, v, g = make_inputs(50, dtype=torch.bfloat16)
    if autograd:
        o = forgetting_attention(q.requires_grad_(), k, v, g, block_size=16)
        o.float().sum().backward()
        assert q.grad.dtype == torch.bfloat16 and torch.isfinite(q.grad).all()
        o = o.detach()
        o32 = forgetting_attention(q.detach().float().requires_grad_(), k.float(), v.float(), g, block_size=16)
    else:
        with torch.no_grad():
            o = forgetting_attention(q, k, v, g, block_size=16)
            o32 = forgetting_attention(q.float(), k.float(), v.float(), g, block_size=16)
    assert o.dtype == torch.bfloat16
    # the same bf16 values in float32: the math is float32 either way, only o is rounded to bf16
    torch.testing.assert_close(o, o32.detach().to(torch.bfloat16), rtol=0, atol=0)
    o_ref = naive_forgetting_attn(q.detach(), k, v, g)
    torch.testing.assert_close(o.float(), o_ref.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("gate", [True, False], ids=["gate", "no_gate"])
def test_without_grouped_sdpa(monkeypatch, gate):
    # torch < 2.5 has no enable_gqa: key/value heads are then repeated for scaled_dot_product_attention
    q, k, v, g = make_inputs(40)
    g = g if gate else None
    with torch.no_grad():
        expected = forgetting_attention(q[:, 5:], k, v, g, block_size=16)
        monkeypatch.setattr(forgetting_attention_torch, "_SDPA_HAS_GQA", False)
        torch.testing.assert_close(forgetting_attention(q[:, 5:], k, v, g, block_size=16), expected,
                                   rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(forgetting_attention(q, k, v), causal_softmax_attention(q, k, v),
                                   rtol=1e-6, atol=1e-6)


def test_no_queries():
    q, k, v, g = make_inputs(8)
    assert forgetting_attention(q[:, :0], k, v, g).shape == (B, 0, HQ, DV)


def test_rejects_bad_shapes():
    q, k, v, g = make_inputs(8)
    with pytest.raises(ValueError, match="must be"):
        forgetting_attention(q[0], k, v, g)
    with pytest.raises(ValueError, match="mismatched"):
        forgetting_attention(q, k[..., :8], v, g)
    with pytest.raises(ValueError, match="multiple"):
        forgetting_attention(q[:, :, :3], k, v, g[..., :3])
    with pytest.raises(ValueError, match="more queries"):
        forgetting_attention(q, k[:, :4], v[:, :4])
    with pytest.raises(ValueError, match="log_fgate"):
        forgetting_attention(q, k, v, g[:, :4])
    with pytest.raises(ValueError, match="key_valid"):
        forgetting_attention(q, k, v, g, key_valid=torch.ones(B, 8))


# -- the eager path that returns the weights (output_attentions) ------------------------------------------------------

@pytest.mark.parametrize("case", ["gate", "no_gate", "suffix", "padded", "padded_suffix", "mqa"])
def test_eager_weights_path_equals_the_blockwise_op(case):
    """``forgetting_attention_with_weights`` gives the blockwise op's outputs and gradients (both of its paths), and
    weights equal to the float64 definition's."""
    torch.manual_seed(0)
    q, k, v, g, valid = padded_inputs(40, heads=(4, 1) if case == "mqa" else (HQ, HK))
    g = None if case == "no_gate" else g
    valid = valid if "padded" in case else None
    if valid is None and g is not None:
        g = g.clamp(min=-5.0)  # (the garbage gate of padded_inputs' holes, where nothing masks it)
    start = 15 if "suffix" in case else 0
    inputs = (q[:, start:], k, v, g)
    eager = functools.partial(forgetting_attention_with_weights, key_valid=valid)
    blockwise = functools.partial(forgetting_attention, key_valid=valid, block_size=8)

    o, weights = eager(*inputs)
    expected_o, expected_weights = reference(*inputs, key_valid=valid, return_weights=True)
    torch.testing.assert_close(weights, expected_weights.float(), **EXACT_TOL)
    torch.testing.assert_close(o, expected_o.float(), **EXACT_TOL)
    with torch.no_grad():
        torch.testing.assert_close(o, blockwise(*inputs), **FP32_TOL)  # the inference path
    assert weights.shape == (B, q.shape[2], 40 - start, 40)
    rows = weights.sum(-1)  # 1 for every query at a real slot, 0 at padding slots
    real = torch.ones(B, 40 - start, dtype=torch.bool) if valid is None else valid[:, start:]
    torch.testing.assert_close(rows, real[:, None, :].float().expand_as(rows))

    do = torch.randn_like(o)
    names = ["dq", "dk", "dv", "dg"][: 3 if g is None else 4]
    differentiable = inputs[: len(names)]
    assert_close_all(grads(lambda *x: eager(*x, *inputs[len(x):])[0], differentiable, do),
                     grads(lambda *x: blockwise(*x, *inputs[len(x):]), differentiable, do), names, **GRAD_TOL)
