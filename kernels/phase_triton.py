"""Selective RoPE's phase increments in Triton, for the default phase path (issue 46, item 1): the first pass of the
fused op from the input (``rotary_fused_triton``), which the rotary op takes on ``"triton"``, and a function of its
own (``phase_increment_triton``).

``_phase_increment_kernel`` computes, for every token and key head, what ``SelectiveRotaryEmbedding.phase_increment``
computes for a ``"low_rank"`` projection, the per-head gate (or none), a learned causal convolution (or the fixed
difference, or none; its activation ``None`` or ``"silu"``) and the optional bias, continuing a cached convolution
history or from a sequence start:

    u = chunk / max(‖chunk‖, 1e-12),  a = up_h (down_h u),  c = (act(conv(a)) + exp(b)) · sigmoid(w_h·u_all + g_h)

in float64, rounded once to float32, zero at padding (``lengths``, right-padded rows) and restarting at packed
sequences' boundaries (``cu_seqlens``), with the convolution's new history (the last K - 1 real inputs). One launch,
one program per (sequence x key head, time chunk), walking its chunk in 16-token tiles and each input chunk 64 dims
at a time; a program computes each token's projection once, the K - 1 before its chunk (the convolution's window)
too, rather than reading another program's. With the gate, one launch before it (``_gate_kernel``, one program per
32 tokens of a row) computes every head's gate: each gate reads every input chunk, which each key head's program did
again. For the fused op the chunks are the rotary scan's (``rotary_triton._plan``) and the kernel also writes each
chunk's total (the scan's pass 1), so the forward is these launches and the rotation's. The sums run in another
order than the torch path's matrix products: equal within float64 rounding, which the rounding to float32 absorbs
(``tests/kernels/test_phase_triton.py``).

``phase_increment_backward_triton`` gives the gradients of those increments with respect to the input and every
weight (projection, taps, bias, gate), recomputing the forward instead of keeping anything from it. One launch, one
program per (sequence, tile of up to 32 tokens) with a gate (each gate reads every chunk, so a chunk's dx needs every
head's gate gradient: the program does every head, in two passes, the first for the gate logits and ``Σ_r dc·y``),
per (sequence x key head, tile) without one. The program recomputes the convolution's window K - 1 tokens before
its tile (its first tokens' z) and K - 1 after it (the later tokens whose windows reach back into the tile give its
``d a``), so no program reads another's results; the convolution's shifts are gathers over the tile, and the
projections, the gate and their gradients float64 ``tl.dot`` products (the float64 MMA on sm_80 and later), over
each chunk 64 dims and each head's channels 16 at a time (whole float64 tiles per head spill on a GPU). The
weight gradients are sums over tokens: each program adds its share with float64 atomics into one zeroed buffer, and
the last program to finish (a count in the same buffer) rounds them once into the weights' dtypes, so the backward is
that one launch and its outputs' allocations. Float64 atomics add in no fixed order: the float64 sums may differ in
their last bits from run to run on a GPU (the interpreter runs the programs in order), which the rounding to float32
weights almost always absorbs. The cached history ``conv_state`` is a constant (no gradient). In the fused op from
the input (``rotary_fused_triton``) the same launch also finishes the rotary backward's walk (``WalkSums``): it adds
the later time chunks' sums to every incoming gradient it reads, writes d(initial phase) and sums d(temperature), so
that op's backward is two launches whatever its chunk plan.

Not yet: the other projections and gates (they keep the PyTorch phase path).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .rotary_triton import _add, _cdiv, _next_power_of_2, _sigmoid, _span, _sum0

try:  # (see rotary_triton: triton is optional, and this file may travel with saved models)
    import triton
    import triton.language as tl
except ImportError as error:
    raise ImportError("the Triton Selective RoPE kernels need `triton` (pip install triton)") from error

__all__ = ["phase_increment_backward_triton", "phase_increment_triton"]

_BLOCK_T = 16
_BLOCK_D = 64  # chunk dims per step of the forward's walk over a chunk: a power of 2, >= 16


# Reductions through our own combine function and zeros from tl.full, as in rotary_triton (its comment says why).
@triton.jit
def _sum1(x):
    return tl.reduce(x, 1, _add)


@triton.jit
def _projection(x_ptr, down_ptr, up_ptr, b, hk, ts, mask_t, sx_b, sx_t, Dc, RANK, R,
                BLOCK_T: tl.constexpr, BLOCK_DC: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_RANK: tl.constexpr):
    """``a = up_h (down_h u)`` of tokens ``ts``: ``(BLOCK_T, BLOCK_R)`` float64, zero where ``mask_t`` is False. The
    chunk walked BLOCK_DC dims at a time (its norm, then ``down_h u``: a whole (16, 256) float64 tile spills), and
    float64 ``tl.dot`` products as the backward computes them: a loop over the rank cost the interpreter (the CPU
    tests' Triton) ~10x the model's whole training step."""
    x_rows = x_ptr + b * sx_b
    denom, _ = _chunk_norms(x_rows, ts, mask_t, hk, sx_t, Dc, BLOCK_T, BLOCK_DC)
    low, _ = _low_projection(x_rows, down_ptr, down_ptr, hk, ts, mask_t, denom, sx_t, 1, Dc, RANK, False, BLOCK_T,
                             BLOCK_DC, BLOCK_RANK, 16)  # (BLOCK_T, BLOCK_RANK)
    return _dot(low, tl.trans(_up_tile(up_ptr, hk, 0, R, RANK, BLOCK_R, BLOCK_RANK)))


@triton.jit
def _conv_inputs(x_ptr, down_ptr, up_ptr, state_ptr, b, n, hk, bos, real_end, ts, Hk, R, Dc, RANK, sx_b, sx_t,
                 CONV_K: tl.constexpr, HAS_STATE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_DC: tl.constexpr,
                 BLOCK_R: tl.constexpr, BLOCK_RANK: tl.constexpr):
    """The convolution's inputs ``a`` of tokens ``ts`` ``(BLOCK_T, BLOCK_R)`` float64: the projection of the real
    tokens from ``bos`` on, the cached history before it (slot K-1 - (bos - token)), zeros elsewhere."""
    a = _projection(x_ptr, down_ptr, up_ptr, b, hk, ts, (ts >= bos) & (ts < real_end), sx_b, sx_t, Dc, RANK, R,
                    BLOCK_T, BLOCK_DC, BLOCK_R, BLOCK_RANK)
    if HAS_STATE:
        rs = tl.arange(0, BLOCK_R)
        slot = ts - bos + (CONV_K - 1)
        mask = ((ts < bos) & (slot >= 0))[:, None] & (rs < R)[None, :]
        a += tl.load(state_ptr + (n * (CONV_K - 1) + slot[:, None]) * (Hk * R) + hk * R + rs[None, :], mask=mask,
                     other=0.0)
    return a


@triton.jit
def _increment_tile(x_ptr, down_ptr, up_ptr, conv_ptr, bias_ptr, gate_ptr, b, hk, ts, mask_t, a, a_before, T, Hk, R,
                    Dc, RANK, sx_b, sx_t, CONV_K: tl.constexpr, SILU: tl.constexpr, HAS_BIAS: tl.constexpr,
                    HAS_GATE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_DC: tl.constexpr, BLOCK_R: tl.constexpr,
                    BLOCK_RANK: tl.constexpr):
    """The increments of tokens ``ts`` (key head ``hk``, batch row ``b``): ``(BLOCK_T, BLOCK_R)`` float64, not yet
    rounded, zero where ``mask_t`` is False (padding, or past the tile). With a convolution, ``a`` and ``a_before``
    are its inputs (``_conv_inputs``) on these tokens and on the ``BLOCK_T`` before them: each tap reads them shifted
    (gathers), so no token's projection is computed twice."""
    rs = tl.arange(0, BLOCK_R)
    mask_r = rs < R
    if CONV_K > 0:  # taps oldest first: tap j reads K-1-j tokens back
        c = tl.full([BLOCK_T, BLOCK_R], 0.0, tl.float64)
        for j in tl.static_range(CONV_K):
            window = _shift(a, CONV_K - 1 - j, BLOCK_T) + _shift(a_before, CONV_K - 1 - j - BLOCK_T, BLOCK_T)
            tap = tl.load(conv_ptr + (hk * R + rs) * CONV_K + j, mask=mask_r, other=0.0).to(tl.float64)
            c += window * tap[None, :]
        if SILU:
            c = c * _sigmoid(c)
    else:
        c = _projection(x_ptr, down_ptr, up_ptr, b, hk, ts, mask_t, sx_b, sx_t, Dc, RANK, R, BLOCK_T, BLOCK_DC,
                        BLOCK_R, BLOCK_RANK)
    if HAS_BIAS:
        c += tl.exp(tl.load(bias_ptr + hk * R + rs, mask=mask_r, other=0.0).to(tl.float64))[None, :]
    if HAS_GATE:  # the per-head gate: every head's for these tokens, computed once by _gate_kernel
        c *= tl.load(gate_ptr + (b * T + ts) * Hk + hk, mask=mask_t, other=0.0)[:, None]
    return tl.where(mask_t[:, None], c, 0.0)  # padding advances no phase


@triton.jit
def _phase_increment_kernel(
    x_ptr, down_ptr, up_ptr, conv_ptr, bias_ptr, gate_ptr, lengths_ptr, cu_ptr, state_ptr, init_ptr, out_ptr,
    new_state_ptr, totals_ptr,
    T, Hk, R, Dc, RANK, NC, CHUNK,
    sx_b, sx_t,
    CONV_K: tl.constexpr, SILU: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_GATE: tl.constexpr,
    HAS_LENGTHS: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_STATE: tl.constexpr, WRITE_STATE: tl.constexpr,
    WRITE_TOTALS: tl.constexpr, HAS_INIT: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_DC: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_RANK: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """One program per (sequence x key head, time chunk of ``CHUNK`` tokens), walking its chunk in tiles of
    ``BLOCK_T``. ``WRITE_TOTALS``: also pass 1 of the rotary scan (``rotary_triton._chunk_totals_kernel``'s output):
    the float64 sum of the chunk's rounded increments into slot ``chunk + 1`` of a ``(N * Hk, NC + 1, R)`` buffer,
    the initial phase (or zeros) into slot 0."""
    pid_nh, pid_c = tl.program_id(0), tl.program_id(1)
    hk = pid_nh % Hk
    n = (pid_nh // Hk).to(tl.int64)
    b, bos, end = _span(pid_nh // Hk, cu_ptr, T, IS_VARLEN)
    valid_end = end
    if HAS_LENGTHS:  # right-padded rows: tokens from the row's length on are padding
        valid_end = bos + tl.load(lengths_ptr + b).to(tl.int64)
    start = bos + pid_c.to(tl.int64) * CHUNK
    chunk_end = tl.minimum(start + CHUNK, end)  # the tokens this program writes (zeros at padding)
    real_end = tl.minimum(chunk_end, valid_end)
    rs = tl.arange(0, BLOCK_R)
    mask_r = rs < R
    channels = Hk * R
    total = tl.full([BLOCK_R], 0.0, tl.float64)
    # The convolution's inputs of the tile before (the window of the first tile's tokens), then carried from tile to
    # tile: each token's projection is computed once, not once per tap.
    a = tl.full([BLOCK_T, BLOCK_R], 0.0, tl.float64)
    if CONV_K > 0:
        a = _conv_inputs(x_ptr, down_ptr, up_ptr, state_ptr, b, n, hk, bos, real_end,
                         start - BLOCK_T + tl.arange(0, BLOCK_T), Hk, R, Dc, RANK, sx_b, sx_t, CONV_K, HAS_STATE,
                         BLOCK_T, BLOCK_DC, BLOCK_R, BLOCK_RANK)
    for t0 in range(start, chunk_end, BLOCK_T):
        ts = t0 + tl.arange(0, BLOCK_T)
        a_before = a
        if CONV_K > 0:
            a = _conv_inputs(x_ptr, down_ptr, up_ptr, state_ptr, b, n, hk, bos, real_end, ts, Hk, R, Dc, RANK, sx_b,
                             sx_t, CONV_K, HAS_STATE, BLOCK_T, BLOCK_DC, BLOCK_R, BLOCK_RANK)
        c = _increment_tile(x_ptr, down_ptr, up_ptr, conv_ptr, bias_ptr, gate_ptr, b, hk, ts, ts < real_end, a,
                            a_before, T, Hk, R, Dc, RANK, sx_b, sx_t, CONV_K, SILU, HAS_BIAS, HAS_GATE, BLOCK_T,
                            BLOCK_DC, BLOCK_R, BLOCK_RANK).to(tl.float32)  # rounded once
        # (B, T, Hk, R) float32, contiguous
        offsets = ((b * T + ts[:, None]) * Hk + hk) * R + rs[None, :]
        tl.store(out_ptr + offsets, c, mask=(ts < chunk_end)[:, None] & mask_r[None, :])
        if WRITE_TOTALS:
            total += _sum0(c.to(tl.float64))  # (zero past the chunk: masked in _increment_tile)
    if WRITE_TOTALS:
        row = pid_nh.to(tl.int64) * (NC + 1)
        tl.store(totals_ptr + (row + pid_c + 1) * R + rs, total, mask=mask_r)
        if pid_c == 0:
            first = tl.full([BLOCK_R], 0.0, tl.float64)
            if HAS_INIT:
                first = tl.load(init_ptr + pid_nh.to(tl.int64) * R + rs, mask=mask_r, other=0.0)
            tl.store(totals_ptr + row * R + rs, first, mask=mask_r)

    if WRITE_STATE:  # the new history: the last K-1 inputs of the real tokens (continuing the cached one)
        if pid_c == 0:
            slots = tl.arange(0, BLOCK_S)
            tokens = valid_end - (CONV_K - 1) + slots
            in_slots = slots < CONV_K - 1
            # (names of their own: Triton keeps a variable's shape across branches, and these are (BLOCK_S, ...))
            last = _projection(x_ptr, down_ptr, up_ptr, b, hk, tokens, (tokens >= bos) & in_slots, sx_b, sx_t, Dc,
                               RANK, R, BLOCK_S, BLOCK_DC, BLOCK_R, BLOCK_RANK)
            if HAS_STATE:
                old_slot = tokens - bos + (CONV_K - 1)
                old_mask = (in_slots & (tokens < bos) & (old_slot >= 0))[:, None] & mask_r[None, :]
                last += tl.load(state_ptr + (n * (CONV_K - 1) + old_slot[:, None]) * channels + hk * R + rs[None, :],
                                mask=old_mask, other=0.0)
            tl.store(new_state_ptr + (n * (CONV_K - 1) + slots[:, None]) * channels + hk * R + rs[None, :], last,
                     mask=in_slots[:, None] & mask_r[None, :])


def phase_increment_triton(
    x: torch.Tensor,
    down: torch.Tensor,
    up: torch.Tensor,
    conv_weight: torch.Tensor | None = None,
    conv_activation: str | None = None,
    bias: torch.Tensor | None = None,
    gate_weight: torch.Tensor | None = None,
    gate_bias: torch.Tensor | None = None,
    lengths: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    conv_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The phase increments of the default phase path, ``(B, T, Hk, R)`` float32, and the convolution's new history.

    Args:
        x: ``(B, T, Hk * Dc)`` the phase input (any float dtype; rows and tokens may be strided).
        down: ``(Hk, rank, Dc)``; up: ``(Hk, R, rank)``: the ``"low_rank"`` projection.
        conv_weight: ``(Hk * R, K)`` the convolution's taps (the last on the current token), or ``None``; or the
            ``(Hk * R, 1, K)`` weight of a depthwise ``nn.Conv1d`` as it is (no view to make).
        conv_activation: ``None`` or ``"silu"``.
        bias: ``(Hk, R)`` the raw bias ``b`` (``exp(b)`` is added), or ``None``.
        gate_weight: ``(Hk, Hk * Dc)``; gate_bias: ``(Hk,)``: the per-head gate, or ``None`` for no gate.
        lengths: ``(B,)`` real tokens per right-padded row, or ``None``.
        cu_seqlens: ``(N + 1,)`` packed sequences' offsets (``B == 1``), or ``None``.
        conv_state: ``(N, K-1, Hk * R)`` the convolution's cached history, oldest first, float64 (``None``: zeros,
            a sequence start).

    Returns:
        The increments and, with a convolution, its new history ``(N, K-1, Hk * R)`` float64: the last K-1 inputs of
        each row's real tokens or each packed sequence, continuing ``conv_state`` where there are fewer (``None``
        without a convolution), as ``SelectiveRotaryEmbedding.phase_increment`` returns them.
    """
    num_seqs, conv_k = _check_phase_inputs(None, x, down, up, conv_weight, conv_activation, bias, gate_weight,
                                           gate_bias, lengths, cu_seqlens, conv_state)
    batch, seq_len = x.shape[:2]
    num_key_heads, rotary_pairs = up.shape[:2]
    out = torch.empty(batch, seq_len, num_key_heads, rotary_pairs, dtype=torch.float32, device=x.device)
    new_state = None if conv_weight is None else x.new_empty(num_seqs, conv_k - 1, num_key_heads * rotary_pairs,
                                                             dtype=torch.float64)
    if num_seqs == 0 or rotary_pairs == 0:
        return out.zero_(), new_state
    _launch(x, down, up, conv_weight, conv_activation == "silu", bias, gate_weight, gate_bias, lengths, cu_seqlens,
            conv_state, out, new_state, _BLOCK_T, max(_cdiv(seq_len, _BLOCK_T), 1))
    return out, new_state



def _dense(tensor: torch.Tensor | None, dtype: torch.dtype | None = None) -> torch.Tensor | None:
    """``tensor`` contiguous (in ``dtype``), with no dispatched op where it already is (each costs host time)."""
    if tensor is None:
        return None
    if dtype is not None and tensor.dtype != dtype:
        tensor = tensor.to(dtype)
    return tensor if tensor.is_contiguous() else tensor.contiguous()


def _launch(x, down, up, conv_weight, silu: bool, bias, gate_weight, gate_bias, lengths, cu_seqlens, conv_state, out,
            new_state, chunk: int, chunks: int, totals: torch.Tensor | None = None,
            initial_phase: torch.Tensor | None = None) -> None:
    """One launch of ``_phase_increment_kernel`` over ``chunks`` chunks of ``chunk`` tokens per (sequence, key head):
    the increments into ``out`` and the new history into ``new_state``; with ``totals`` ``(N * Hk, chunks + 1, R)``
    float64, also the rotary scan's pass 1 (the chunks' totals after ``initial_phase`` ``(N, Hk, R)`` float64)."""
    seq_len = x.shape[1]
    num_key_heads, rank, chunk_dim = down.shape
    rotary_pairs = up.shape[1]
    conv_k = 0 if conv_weight is None else conv_weight.shape[-1]
    num_seqs = x.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    x = x if x.stride(-1) == 1 else x.contiguous()
    placeholder = out  # for pointers a disabled branch never reads
    gate = None if gate_weight is None else _gates(x, gate_weight, gate_bias)
    _phase_increment_kernel[(num_seqs * num_key_heads, chunks)](  # (chunk 0 writes the new history)
        x, _dense(down), _dense(up), _dense(conv_weight) if conv_weight is not None else placeholder,
        _dense(bias) if bias is not None else placeholder, gate if gate is not None else placeholder,
        _dense(lengths, torch.int64) if lengths is not None else placeholder,
        _dense(cu_seqlens, torch.int32) if cu_seqlens is not None else placeholder,
        _dense(conv_state, torch.float64) if conv_state is not None else placeholder,
        initial_phase if initial_phase is not None else placeholder, out,
        new_state if new_state is not None else placeholder, totals if totals is not None else placeholder,
        seq_len, num_key_heads, rotary_pairs, chunk_dim, rank, chunks, chunk, x.stride(0), x.stride(1),
        CONV_K=conv_k, SILU=silu,
        HAS_BIAS=bias is not None, HAS_GATE=gate_weight is not None, HAS_LENGTHS=lengths is not None,
        IS_VARLEN=cu_seqlens is not None, HAS_STATE=conv_state is not None, WRITE_STATE=conv_k > 1,
        WRITE_TOTALS=totals is not None, HAS_INIT=initial_phase is not None,
        # (every block >= 16: tl.dot's minimum; the history's K - 1 slots too)
        # (a tile holds at least the convolution's window: the taps read the tile before it, K - 1 <= BLOCK_T)
        BLOCK_T=max(_BLOCK_T, _next_power_of_2(conv_k - 1)),
        BLOCK_DC=max(min(_next_power_of_2(chunk_dim), _BLOCK_D), 16),
        BLOCK_R=max(_next_power_of_2(rotary_pairs), 16), BLOCK_RANK=max(_next_power_of_2(rank), 16),
        BLOCK_S=max(_next_power_of_2(conv_k - 1), 16), num_warps=8,
    )


def _gates(x: torch.Tensor, gate_weight: torch.Tensor, gate_bias: torch.Tensor) -> torch.Tensor:
    """Every per-head gate of every token, ``(B, T, Hk)`` float64 (padding too: its increments are zeroed later), in
    one launch of ``_gate_kernel``. Each gate reads every input chunk: computed once per token here, not once per key
    head in ``_phase_increment_kernel``'s programs, where it was most of a tile's work (16 key heads of the 370M FoX:
    the phase kernel took 3.19 ms of an H200 for 4 x 4096 tokens, docs/gpu_performance.md)."""
    batch, seq_len = x.shape[:2]
    num_key_heads = gate_bias.shape[0]
    chunk_dim = x.shape[2] // num_key_heads
    gate = x.new_empty(batch, seq_len, num_key_heads, dtype=torch.float64)
    _gate_kernel[(batch, max(_cdiv(seq_len, _GATE_BLOCK_T), 1))](
        x, _dense(gate_weight), _dense(gate_bias), gate, seq_len, num_key_heads, chunk_dim, x.stride(0), x.stride(1),
        BLOCK_T=_GATE_BLOCK_T, BLOCK_D=max(min(_next_power_of_2(chunk_dim), _BLOCK_D), 16),
        BLOCK_H=max(_next_power_of_2(num_key_heads), 16), num_warps=4,
    )
    return gate


# --------------------------------------------------------------------------------------------------------------------
# backward: recomputes the forward over each tile and its halos, one launch
# --------------------------------------------------------------------------------------------------------------------
_BACKWARD_BLOCK_T = 32  # tokens per backward program, its halos included: a power of 2, >= 16 (tl.dot's minimum)
_BACKWARD_BLOCK_R = 16  # channels (rotary pairs) per step of the backward's walk over a head's: a power of 2, >= 16
_BACKWARD_BLOCK_D = 64  # chunk dims per step of the backward's walk over a chunk: a power of 2, >= 16
_COPY_BLOCK = 1024  # elements per step of the last program's copy of the weight gradients
_GATE_BLOCK_T = 32  # tokens per program of _gate_kernel (every head's gate): a power of 2, >= 16


@triton.jit
def _dot(a, b):
    """``a @ b`` in float64 (the float64 MMA on sm_80 and later); every dimension >= 16."""
    return tl.dot(a, b, out_dtype=tl.float64)


@triton.jit
def _column(m, cols, j):
    """Column ``j`` of ``m`` ``(BLOCK_E, BLOCK_H)``, ``cols = tl.arange(0, BLOCK_H)``."""
    return _sum1(tl.where(cols[None, :] == j, m, 0.0))


@triton.jit
def _shift(v, m: tl.constexpr, BLOCK_E: tl.constexpr):
    """``v[e - m]`` along the tokens (rows) of ``v`` ``(BLOCK_E, ...)``, zero where ``e - m`` leaves the block:
    ``m > 0`` reads earlier tokens, ``m < 0`` later ones."""
    es = tl.arange(0, BLOCK_E)
    src = es - m
    inside = (src >= 0) & (src < BLOCK_E)
    index = tl.broadcast_to(tl.where(inside, src, 0)[:, None], v.shape)
    return tl.where(inside[:, None], tl.gather(v, index, 0), 0.0)


@triton.jit
def _x_block(x_rows, es, real, chunk, d0, sx_t, Dc, BLOCK_D: tl.constexpr):
    """Dims ``d0 .. d0 + BLOCK_D`` of input chunk ``chunk`` over the block's tokens (rows ``es`` from ``x_rows``, the
    first token's row): ``(BLOCK_E, BLOCK_D)`` float64, zero where not ``real`` and past the chunk."""
    ds = d0 + tl.arange(0, BLOCK_D)
    return tl.load(x_rows + es[:, None] * sx_t + chunk * Dc + ds[None, :],
                   mask=real[:, None] & (ds < Dc)[None, :], other=0.0).to(tl.float64)


@triton.jit
def _chunk_norms(x_rows, es, real, chunk, sx_t, Dc, BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr):
    """The clamped L2 norms of input chunk ``chunk`` over the block's tokens ``(BLOCK_E,)`` float64 and where the norm
    is not clamped (``L2NormalizeChunks``' backward reads both), walking the chunk BLOCK_D dims at a time."""
    squares = tl.full([BLOCK_E], 0.0, tl.float64)
    for d0 in range(0, Dc, BLOCK_D):
        x = _x_block(x_rows, es, real, chunk, d0, sx_t, Dc, BLOCK_D)
        squares += _sum1(x * x)
    norm = tl.sqrt(squares)
    return tl.maximum(norm, 1e-12), norm >= 1e-12


@triton.jit
def _unit_block(x_rows, es, real, chunk, d0, denom, sx_t, Dc, BLOCK_D: tl.constexpr):
    """``u`` on dims ``d0 .. d0 + BLOCK_D`` of chunk ``chunk``: its inputs over their chunk's norms ``denom``."""
    u = _x_block(x_rows, es, real, chunk, d0, sx_t, Dc, BLOCK_D) / denom[:, None]
    # Through an identity gather: Triton 3.6 fails to compile a float64 tl.dot whose operand it traces back, through
    # elementwise ops, to a 16-bit load ("Currently fp64 don't support largeK MMA", bf16 x); the gather ends the trace.
    return tl.gather(u, tl.broadcast_to(tl.arange(0, u.shape[0])[:, None], u.shape), 0)


@triton.jit
def _down_block(down_ptr, h, d0, Dc, RANK, BLOCK_RANK: tl.constexpr, BLOCK_D: tl.constexpr):
    """``down_h`` on dims ``d0 .. d0 + BLOCK_D``: ``(BLOCK_RANK, BLOCK_D)`` float64."""
    ks, ds = tl.arange(0, BLOCK_RANK), d0 + tl.arange(0, BLOCK_D)
    return tl.load(down_ptr + (h * RANK + ks[:, None]) * Dc + ds[None, :],
                   mask=(ks < RANK)[:, None] & (ds < Dc)[None, :], other=0.0).to(tl.float64)


@triton.jit
def _gate_block(gw_ptr, chunk, d0, Hk, Dc, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """Every per-head gate's weights on dims ``d0 .. d0 + BLOCK_D`` of input chunk ``chunk``: ``(BLOCK_H, BLOCK_D)``
    float64."""
    hs, ds = tl.arange(0, BLOCK_H), d0 + tl.arange(0, BLOCK_D)
    return tl.load(gw_ptr + hs[:, None] * (Hk * Dc) + chunk * Dc + ds[None, :],
                   mask=(hs < Hk)[:, None] & (ds < Dc)[None, :], other=0.0).to(tl.float64)


@triton.jit
def _up_tile(up_ptr, h, r0, R, RANK, BLOCK_R: tl.constexpr, BLOCK_RANK: tl.constexpr):
    """Rows ``r0 .. r0 + BLOCK_R`` of ``up_h``: ``(BLOCK_R, BLOCK_RANK)`` float64."""
    rs, ks = r0 + tl.arange(0, BLOCK_R), tl.arange(0, BLOCK_RANK)
    return tl.load(up_ptr + (h * R + rs[:, None]) * RANK + ks[None, :], mask=(rs < R)[:, None] & (ks < RANK)[None, :],
                   other=0.0).to(tl.float64)


@triton.jit
def _low_projection(x_rows, down_ptr, gw_ptr, h, es, real, denom, sx_t, Hk, Dc, RANK,
                    GATE_LOGITS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_RANK: tl.constexpr, BLOCK_H: tl.constexpr):
    """``low = down_h u`` of key head ``h`` ``(BLOCK_E, BLOCK_RANK)`` and, with ``GATE_LOGITS``, chunk ``h``'s share
    of every gate's logit ``(BLOCK_E, BLOCK_H)`` (zeros without), float64: the chunk walked BLOCK_D dims at a time,
    so no ``(BLOCK_E, Dc)`` tile is held."""
    low = tl.full([BLOCK_E, BLOCK_RANK], 0.0, tl.float64)
    logits = tl.full([BLOCK_E, BLOCK_H], 0.0, tl.float64)
    for d0 in range(0, Dc, BLOCK_D):
        u = _unit_block(x_rows, es, real, h, d0, denom, sx_t, Dc, BLOCK_D)
        low += _dot(u, tl.trans(_down_block(down_ptr, h, d0, Dc, RANK, BLOCK_RANK, BLOCK_D)))
        if GATE_LOGITS:
            logits += _dot(u, tl.trans(_gate_block(gw_ptr, h, d0, Hk, Dc, BLOCK_H, BLOCK_D)))
    return low, logits


@triton.jit
def _gate_kernel(x_ptr, gw_ptr, gb_ptr, gate_ptr, T, Hk, Dc, sx_b, sx_t,
                 BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr):
    """Every per-head gate ``sigmoid(w_h · u + g_h)`` of ``BLOCK_T`` tokens of row ``b`` (``u``: every input chunk
    over its own norm), ``(BLOCK_T, Hk)`` float64 into ``gate_ptr`` ``(B, T, Hk)``: the logits as float64
    ``tl.dot`` products over each chunk ``BLOCK_D`` dims at a time, as the backward computes them."""
    b, tile = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    ts = tile * BLOCK_T + tl.arange(0, BLOCK_T)
    real = ts < T
    x_rows = x_ptr + b * sx_b
    logits = tl.full([BLOCK_T, BLOCK_H], 0.0, tl.float64)
    for chunk in range(Hk):
        denom, _ = _chunk_norms(x_rows, ts, real, chunk, sx_t, Dc, BLOCK_T, BLOCK_D)
        for d0 in range(0, Dc, BLOCK_D):
            u = _unit_block(x_rows, ts, real, chunk, d0, denom, sx_t, Dc, BLOCK_D)
            logits += _dot(u, tl.trans(_gate_block(gw_ptr, chunk, d0, Hk, Dc, BLOCK_H, BLOCK_D)))
    hs = tl.arange(0, BLOCK_H)
    mask_h = hs < Hk
    gate = _sigmoid(logits + tl.load(gb_ptr + hs, mask=mask_h, other=0.0).to(tl.float64)[None, :])
    tl.store(gate_ptr + (b * T + ts[:, None]) * Hk + hs[None, :], gate, mask=real[:, None] & mask_h[None, :])


@triton.jit
def _up_projection(low, up_ptr, conv_ptr, state_ptr, n, h, r0, es, start, R, RANK, channels, CONV_K: tl.constexpr,
                   HAS_STATE: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_RANK: tl.constexpr, BLOCK_R: tl.constexpr):
    """Channels ``r0 .. r0 + BLOCK_R`` of ``a = up_h low`` (the cached history before the sequence start, zero at
    padding) and of the convolution ``z`` of ``a`` (meaningful from row K - 1 on; ``a`` itself without a
    convolution): ``(BLOCK_E, BLOCK_R)`` float64."""
    rs = r0 + tl.arange(0, BLOCK_R)
    mask_r = rs < R
    a = _dot(low, tl.trans(_up_tile(up_ptr, h, r0, R, RANK, BLOCK_R, BLOCK_RANK)))  # zero where not real (low is)
    z = a
    if CONV_K > 0:
        if HAS_STATE:  # before the sequence start: the cached history, slot K-1 - (bos - token)
            slot = es - start + (CONV_K - 1)
            before = (es < start) & (slot >= 0)
            a += tl.load(state_ptr + (n * (CONV_K - 1) + slot[:, None]) * channels + h * R + rs[None, :],
                         mask=before[:, None] & mask_r[None, :], other=0.0).to(tl.float64)
        z = tl.full([BLOCK_E, BLOCK_R], 0.0, tl.float64)
        for j in tl.static_range(CONV_K):  # taps oldest first: tap j reads K-1-j tokens back
            tap = tl.load(conv_ptr + (h * R + rs) * CONV_K + j, mask=mask_r, other=0.0).to(tl.float64)
            z += _shift(a, CONV_K - 1 - j, BLOCK_E) * tap[None, :]
    return a, z


@triton.jit
def _chunk_gradient_block(d_low, d_logit, down_ptr, gw_ptr, h, d0, Hk, Dc, RANK, HAS_GATE: tl.constexpr,
                          BLOCK_D: tl.constexpr, BLOCK_RANK: tl.constexpr, BLOCK_H: tl.constexpr):
    """``du`` on dims ``d0 .. d0 + BLOCK_D`` of chunk ``h``: from the projection (``d_low``) and every gate
    (``d_logit``), ``(BLOCK_E, BLOCK_D)`` float64."""
    du = _dot(d_low, _down_block(down_ptr, h, d0, Dc, RANK, BLOCK_RANK, BLOCK_D))
    if HAS_GATE:
        du += _dot(d_logit, _gate_block(gw_ptr, h, d0, Hk, Dc, BLOCK_H, BLOCK_D))
    return du


@triton.jit
def _rounded(x, dtype: tl.constexpr):
    """Float64 ``x`` in ``dtype``: to a 16-bit float through float32, as torch casts float64 to one (so as autograd's
    cast of the float64 gradient rounds it)."""
    if dtype.primitive_bitwidth < 32:
        return x.to(tl.float32).to(dtype)
    return x.to(dtype)


@triton.jit
def _copy_out(src_ptr, dst_ptr, count, BLOCK: tl.constexpr):
    """``dst[:count] = src[:count]`` in ``dst``'s dtype, reading past the L1 cache (other programs' atomics wrote
    ``src``)."""
    for start in range(0, count, BLOCK):
        i = start + tl.arange(0, BLOCK)
        value = tl.load(src_ptr + i, mask=i < count, other=0.0, cache_modifier=".cg")
        tl.store(dst_ptr + i, _rounded(value, dst_ptr.dtype.element_ty), mask=i < count)


@triton.jit
def _incoming(grad_rows, sums_ptr, es, real, chunk_row, first_chunk, row, h, r0, Hk, R, NC, LATER: tl.constexpr,
              BLOCK_E: tl.constexpr, BLOCK_R: tl.constexpr):
    """The incoming gradient of head ``h``'s increments on channels ``r0 .. r0 + BLOCK_R`` over the block's rows:
    ``(BLOCK_E, BLOCK_R)`` float64, zero where not ``real``. ``LATER``: ``grad`` holds each chunk walked back alone
    (``rotary_triton._backward_walks(fused=True)``), and what reaches a row's chunk from later in time is added: slots
    ``0 .. NC - 1 - chunk`` of the walk sums' row ``row`` (d final phase, then the later chunks' Σ dθ), summed in slot
    order in float32, as the rotary backward's own second walk sums them. (Read before the channels' projection is
    recomputed: fewer registers live through the slots' loop.)"""
    rs = r0 + tl.arange(0, BLOCK_R)
    mask_r = rs < R
    g = tl.load(grad_rows + (es[:, None] * Hk + h) * R + rs[None, :], mask=real[:, None] & mask_r[None, :], other=0.0)
    if LATER:
        slots = sums_ptr + row * (2 * NC + 1) * R + rs
        last_slot = NC - 1 - chunk_row  # (BLOCK_E,): the row's sum ends at this slot
        running = tl.full([BLOCK_R], 0.0, tl.float32)
        later = tl.full([BLOCK_E, BLOCK_R], 0.0, tl.float32)
        for slot in range(0, NC - first_chunk):
            running += tl.load(slots + slot * R, mask=mask_r, other=0.0)
            later = tl.where((last_slot == slot)[:, None], running[None, :], later)
        g += tl.where(real[:, None], later, 0.0)
    return g.to(tl.float64)


@triton.jit
def _initial_phase_gradient(sums_ptr, dinit_ptr, row, NC, R, BLOCK_R: tl.constexpr):
    """d(initial phase) of walk-sum row ``row`` (a sequence's key head): the sum of slots ``0 .. NC`` (d final phase
    and every chunk's Σ dθ) in slot order, in float32 as the rotary backward sums it, written as float64."""
    for r0 in range(0, R, BLOCK_R):
        rs = r0 + tl.arange(0, BLOCK_R)
        mask_r = rs < R
        total = tl.full([BLOCK_R], 0.0, tl.float32)
        for slot in range(0, NC + 1):
            total += tl.load(sums_ptr + (row * (2 * NC + 1) + slot) * R + rs, mask=mask_r, other=0.0)
        tl.store(dinit_ptr + row * R + rs, total.to(tl.float64), mask=mask_r)


@triton.jit
def _temperature_gradient(sums_ptr, dtemp_ptr, rows, NC, R, BLOCK_I: tl.constexpr, BLOCK_R: tl.constexpr):
    """d(temperature) ``(R,)`` float32: the sum over every walk-sum row and chunk of slots ``NC + 1 ..`` (each chunk's
    share), ``BLOCK_I`` (row, chunk) pairs at a time, in float64, rounded once. (The last program's; ``BLOCK_R``
    >= R.)"""
    rs = tl.arange(0, BLOCK_R)
    mask_r = rs < R
    total = tl.full([BLOCK_R], 0.0, tl.float64)
    for i0 in range(0, rows * NC, BLOCK_I):
        i = i0 + tl.arange(0, BLOCK_I)  # (row, chunk) = (i // NC, i % NC)
        slot = (i // NC) * (2 * NC + 1) + NC + 1 + i % NC
        share = tl.load(sums_ptr + slot[:, None] * R + rs[None, :], mask=(i < rows * NC)[:, None] & mask_r[None, :],
                        other=0.0)
        total += _sum0(share.to(tl.float64))
    tl.store(dtemp_ptr + rs, total.to(tl.float32), mask=mask_r)


@triton.jit
def _phase_increment_bwd_kernel(
    grad_ptr, x_ptr, down_ptr, up_ptr, conv_ptr, bias_ptr, gw_ptr, gb_ptr, lengths_ptr, cu_ptr, state_ptr,
    dx_ptr, ddown_ptr, dup_ptr, dconv_ptr, dbias_ptr, dgw_ptr, dgb_ptr, ws_ptr, sums_ptr, dinit_ptr, dtemp_ptr,
    T, Hk, R, Dc, RANK, NC, CHUNK,
    sx_b, sx_t,
    CONV_K: tl.constexpr, SILU: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_GATE: tl.constexpr,
    HAS_LENGTHS: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_STATE: tl.constexpr, HALO: tl.constexpr,
    WALK_SUMS: tl.constexpr, LATER: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_RANK: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_COPY: tl.constexpr, BLOCK_TEMP: tl.constexpr,
):
    # A program owns TILE tokens of one sequence and recomputes the forward over them and HALO = K-1 tokens either
    # side: the convolution's window before (z of its first tokens) and after (dz of the tokens whose windows reach
    # back into the tile). With a gate, every head (each gate reads every chunk, so dx of a chunk needs every head's
    # gate gradient); without one, a single head. Each chunk is walked BLOCK_D dims at a time (a whole
    # (BLOCK_E, Dc) float64 tile per chunk would spill), recomputing its inputs at each walk rather than holding them.
    # WALK_SUMS (the fused op from the input): the rotary backward's first walk left its sums (``rotary_triton.
    # _backward_walks``), whose d(temperature) shares the last program sums; LATER (several chunks a sequence): each
    # chunk of ``grad`` was walked back alone, so every token read gets what reaches its chunk from later in time
    # added, and each sequence's first program writes d(initial phase).
    TILE: tl.constexpr = BLOCK_E - 2 * HALO
    pid_nh, pid_t = tl.program_id(0), tl.program_id(1)
    if HAS_GATE:
        n_prog = pid_nh
        h_lo = pid_nh * 0
        h_hi = h_lo + Hk
    else:
        n_prog = pid_nh // Hk
        h_lo = pid_nh % Hk
        h_hi = h_lo + 1
    n = n_prog.to(tl.int64)
    b, bos, end = _span(n_prog, cu_ptr, T, IS_VARLEN)
    t0 = bos + pid_t.to(tl.int64) * TILE
    es = tl.arange(0, BLOCK_E)
    ts = t0 - HALO + es  # (BLOCK_E,) the tile and its halos
    valid_end = end
    if HAS_LENGTHS:  # right-padded rows: tokens from the row's length on are padding
        valid_end = bos + tl.load(lengths_ptr + b).to(tl.int64)
    real = (ts >= bos) & (ts < valid_end)  # the increments there depend on the inputs
    owned_end = tl.minimum(end - (t0 - HALO), HALO + TILE)  # (rows es from HALO to this own the gradients)
    owned = (es >= HALO) & (es < owned_end)  # the tokens whose gradients this program writes
    counted = owned & real
    ks, ds, hs = tl.arange(0, BLOCK_RANK), tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_H)
    mask_k, mask_h = ks < RANK, hs < Hk
    channels = Hk * R
    hidden = Hk * Dc
    # Tokens as rows es of the block from its first token (int32 offsets from scalar pointers: int64 token indices
    # in every tile's addresses cost registers)
    t_base = t0 - HALO
    start = (bos - t_base).to(tl.int32)  # the sequence's first token's row (<= 0 past the first tile)
    x_rows = x_ptr + b * sx_b + t_base * sx_t
    grad_rows = grad_ptr + (b * T + t_base) * Hk * R
    dx_rows = dx_ptr + (b * T + t_base) * hidden
    # float64 accumulators of the weight gradients, one after another (the launcher sizes it alike), then a count
    o_up = Hk * RANK * Dc
    o_conv = o_up + Hk * R * RANK
    o_bias = o_conv + Hk * R * CONV_K
    o_gw = o_bias + (Hk * R if HAS_BIAS else 0)
    o_gb = o_gw + (Hk * hidden if HAS_GATE else 0)
    o_count = o_gb + (Hk if HAS_GATE else 0)
    # The chunk of the rotary plan of each row's token, and the first real row's (for LATER)
    chunk_row = tl.maximum(es - start, 0) // CHUNK
    first_chunk = tl.maximum(-start, 0) // CHUNK
    if LATER:
        if pid_t == 0:
            for h in range(h_lo, h_hi):
                _initial_phase_gradient(sums_ptr, dinit_ptr, n * Hk + h, NC, R, BLOCK_R)

    if t0 < end:
        gate = tl.full([BLOCK_E, BLOCK_H], 0.0, tl.float64)
        d_logit = tl.full([BLOCK_E, BLOCK_H], 0.0, tl.float64)  # (stays zero without a gate)
        if HAS_GATE:
            # Pass 1: every head's gate logit and Σ_r dc·y, for d logit = σ'(logit) Σ_r dc·y (y: c before the gate)
            logits = tl.full([BLOCK_E, BLOCK_H], 0.0, tl.float64)
            dot_grad = tl.full([BLOCK_E, BLOCK_H], 0.0, tl.float64)
            for h in range(0, Hk):
                denom, unclamped = _chunk_norms(x_rows, es, real, h, sx_t, Dc, BLOCK_E, BLOCK_D)
                low, logit_share = _low_projection(x_rows, down_ptr, gw_ptr, h, es, real, denom, sx_t, Hk, Dc, RANK,
                                                   True, BLOCK_E, BLOCK_D, BLOCK_RANK, BLOCK_H)
                logits += logit_share
                head_dot = tl.full([BLOCK_E], 0.0, tl.float64)
                for r0 in range(0, R, BLOCK_R):  # the channels BLOCK_R at a time
                    rs = r0 + tl.arange(0, BLOCK_R)
                    mask_r = rs < R
                    g = _incoming(grad_rows, sums_ptr, es, real, chunk_row, first_chunk, n * Hk + h, h, r0, Hk, R,
                                  NC, LATER, BLOCK_E, BLOCK_R)
                    a, y = _up_projection(low, up_ptr, conv_ptr, state_ptr, n, h, r0, es, start, R, RANK, channels,
                                          CONV_K, HAS_STATE, BLOCK_E, BLOCK_RANK, BLOCK_R)
                    if SILU:
                        y = y * _sigmoid(y)
                    if HAS_BIAS:
                        y += tl.exp(tl.load(bias_ptr + h * R + rs, mask=mask_r, other=0.0).to(tl.float64))[None, :]
                    head_dot += _sum1(g * y)
                dot_grad = tl.where(hs[None, :] == h, head_dot[:, None], dot_grad)
            gate = _sigmoid(logits + tl.load(gb_ptr + hs, mask=mask_h, other=0.0).to(tl.float64)[None, :])
            d_logit = tl.where(counted[:, None] & mask_h[None, :], gate * (1.0 - gate) * dot_grad, 0.0)
            tl.atomic_add(ws_ptr + o_gb + hs, _sum0(d_logit), mask=mask_h, sem="relaxed")

        # Pass 2, head by head: the chain back from dc to every input
        for h in range(h_lo, h_hi):
            denom, unclamped = _chunk_norms(x_rows, es, real, h, sx_t, Dc, BLOCK_E, BLOCK_D)
            low, _ = _low_projection(x_rows, down_ptr, gw_ptr, h, es, real, denom, sx_t, Hk, Dc, RANK, False,
                                     BLOCK_E, BLOCK_D, BLOCK_RANK, BLOCK_H)
            if HAS_GATE:
                gate_h = _column(gate, hs, h)
            d_low = tl.full([BLOCK_E, BLOCK_RANK], 0.0, tl.float64)
            for r0 in range(0, R, BLOCK_R):  # the channels BLOCK_R at a time, back to d low
                rs = r0 + tl.arange(0, BLOCK_R)
                mask_r = rs < R
                dy = _incoming(grad_rows, sums_ptr, es, real, chunk_row, first_chunk, n * Hk + h, h, r0, Hk, R, NC,
                               LATER, BLOCK_E, BLOCK_R)  # (BLOCK_E, BLOCK_R), zero where not real
                a, z = _up_projection(low, up_ptr, conv_ptr, state_ptr, n, h, r0, es, start, R, RANK, channels, CONV_K,
                                      HAS_STATE, BLOCK_E, BLOCK_RANK, BLOCK_R)
                if HAS_GATE:
                    dy *= gate_h[:, None]
                if HAS_BIAS:
                    exp_b = tl.exp(tl.load(bias_ptr + h * R + rs, mask=mask_r, other=0.0).to(tl.float64))
                    tl.atomic_add(ws_ptr + o_bias + h * R + rs, _sum0(tl.where(owned[:, None], dy, 0.0)) * exp_b,
                                  mask=mask_r, sem="relaxed")
                if CONV_K > 0:
                    dz = dy
                    if SILU:
                        sig = _sigmoid(z)
                        dz = dy * sig * (1.0 + z * (1.0 - sig))
                    da = tl.full([BLOCK_E, BLOCK_R], 0.0, tl.float64)
                    for j in tl.static_range(CONV_K):  # tap j: z_t += w_j a_{t-(K-1-j)}, so da_s += w_j dz_{s+K-1-j}
                        # and d w_j = Σ_t owned dz_t a_{t-(K-1-j)} = Σ_s a_s dz_{s+K-1-j} where s+K-1-j is owned: one
                        # shift of dz for both, and no shifted copies of a kept from the convolution (registers)
                        later = es + (CONV_K - 1 - j)
                        dz_later = _shift(dz, j + 1 - CONV_K, BLOCK_E)
                        d_tap = _sum0(tl.where(((later >= HALO) & (later < owned_end))[:, None], a * dz_later, 0.0))
                        tl.atomic_add(ws_ptr + o_conv + (h * R + rs) * CONV_K + j, d_tap, mask=mask_r, sem="relaxed")
                        tap = tl.load(conv_ptr + (h * R + rs) * CONV_K + j, mask=mask_r, other=0.0).to(tl.float64)
                        da += dz_later * tap[None, :]
                else:
                    da = dy
                da = tl.where(counted[:, None], da, 0.0)  # (the history before the start and padding are constants)
                tl.atomic_add(ws_ptr + o_up + (h * R + rs[:, None]) * RANK + ks[None, :], _dot(tl.trans(da), low),
                              mask=mask_r[:, None] & mask_k[None, :], sem="relaxed")
                d_low += _dot(da, _up_tile(up_ptr, h, r0, R, RANK, BLOCK_R, BLOCK_RANK))  # (BLOCK_E, BLOCK_RANK)
            # The chunk norm's backward, as L2NormalizeChunks': dx = (du - u (u·du)) / ‖x‖, no u·du where clamped.
            # A first walk over the chunk sums u·du...
            along = tl.full([BLOCK_E], 0.0, tl.float64)
            for d0 in range(0, Dc, BLOCK_D):
                u = _unit_block(x_rows, es, real, h, d0, denom, sx_t, Dc, BLOCK_D)
                du = _chunk_gradient_block(d_low, d_logit, down_ptr, gw_ptr, h, d0, Hk, Dc, RANK, HAS_GATE, BLOCK_D,
                                           BLOCK_RANK, BLOCK_H)
                along += _sum1(u * du)
            along = tl.where(unclamped, along, 0.0)
            # ... and a second, recomputing u and du (two small products) rather than keeping them, writes dx and adds
            # the projection's and the gates' weight gradients (here rather than in the first: fewer spills)
            for d0 in range(0, Dc, BLOCK_D):
                u = _unit_block(x_rows, es, real, h, d0, denom, sx_t, Dc, BLOCK_D)
                du = _chunk_gradient_block(d_low, d_logit, down_ptr, gw_ptr, h, d0, Hk, Dc, RANK, HAS_GATE, BLOCK_D,
                                           BLOCK_RANK, BLOCK_H)
                dx = (du - u * along[:, None]) / denom[:, None]
                tl.store(dx_rows + es[:, None] * hidden + h * Dc + d0 + ds[None, :],
                         _rounded(dx, dx_ptr.dtype.element_ty), mask=owned[:, None] & (d0 + ds < Dc)[None, :])
                tl.atomic_add(ws_ptr + (h * RANK + ks[:, None]) * Dc + d0 + ds[None, :], _dot(tl.trans(d_low), u),
                              mask=mask_k[:, None] & (d0 + ds < Dc)[None, :], sem="relaxed")
                if HAS_GATE:  # every gate's weights on chunk h
                    tl.atomic_add(ws_ptr + o_gw + hs[:, None] * hidden + h * Dc + d0 + ds[None, :],
                                  _dot(tl.trans(d_logit), u), mask=mask_h[:, None] & (d0 + ds < Dc)[None, :],
                                  sem="relaxed")

    # The last program to finish rounds the weight gradients once into their own dtypes (no launch or op after this
    # one). Each program's atomics come before its count (the barrier, then an acq_rel atomic).
    tl.debug_barrier()
    done = tl.atomic_add(ws_ptr + o_count, 1.0)
    if done == (tl.num_programs(0) * tl.num_programs(1) - 1).to(tl.float64):
        _copy_out(ws_ptr, ddown_ptr, o_up, BLOCK_COPY)
        _copy_out(ws_ptr + o_up, dup_ptr, o_conv - o_up, BLOCK_COPY)
        if CONV_K > 0:
            _copy_out(ws_ptr + o_conv, dconv_ptr, o_bias - o_conv, BLOCK_COPY)
        if HAS_BIAS:
            _copy_out(ws_ptr + o_bias, dbias_ptr, o_gw - o_bias, BLOCK_COPY)
        if HAS_GATE:
            _copy_out(ws_ptr + o_gw, dgw_ptr, o_gb - o_gw, BLOCK_COPY)
            _copy_out(ws_ptr + o_gb, dgb_ptr, o_count - o_gb, BLOCK_COPY)
        if WALK_SUMS:
            rows = tl.num_programs(0) * (Hk if HAS_GATE else 1)
            _temperature_gradient(sums_ptr, dtemp_ptr, rows, NC, R, 16, BLOCK_TEMP)


def _check_phase_inputs(grad_increment, x, down, up, conv_weight, conv_activation, bias, gate_weight, gate_bias,
                        lengths, cu_seqlens, conv_state) -> tuple[int, int]:
    """The number of sequences and of taps (0: no convolution), after refusing inputs that disagree by name
    (``grad_increment``: ``None`` for the forward's inputs alone)."""
    batch, seq_len, hidden = x.shape
    num_key_heads, rank, chunk_dim = down.shape
    rotary_pairs = up.shape[1]
    if (hidden != num_key_heads * chunk_dim or up.shape != (num_key_heads, rotary_pairs, rank)
            or (conv_weight is not None and (conv_weight.shape[0] != num_key_heads * rotary_pairs
                                             or conv_weight.shape[1:-1] not in ((), (1,))))
            or (bias is not None and bias.shape != (num_key_heads, rotary_pairs))
            or (gate_weight is not None and (gate_weight.shape != (num_key_heads, hidden) or gate_bias is None
                                             or gate_bias.shape != (num_key_heads,)))):
        raise ValueError(f"x {tuple(x.shape)}, down {tuple(down.shape)}, up {tuple(up.shape)}, conv_weight "
                         f"{None if conv_weight is None else tuple(conv_weight.shape)}, bias "
                         f"{None if bias is None else tuple(bias.shape)} and gate weight "
                         f"{None if gate_weight is None else tuple(gate_weight.shape)} disagree")
    if grad_increment is not None and grad_increment.shape != (batch, seq_len, num_key_heads, rotary_pairs):
        raise ValueError(f"grad_increment {tuple(grad_increment.shape)} is not the increments' shape "
                         f"{(batch, seq_len, num_key_heads, rotary_pairs)}")
    if conv_activation not in (None, "silu"):
        raise ValueError(f"unsupported activation {conv_activation!r}; expected None or 'silu'")
    if cu_seqlens is not None and (batch != 1 or lengths is not None):
        raise ValueError("cu_seqlens needs batch 1 and no lengths (packed sequences have no padding)")
    num_seqs = batch if cu_seqlens is None else cu_seqlens.shape[0] - 1
    conv_k = 0 if conv_weight is None else conv_weight.shape[-1]
    channels = num_key_heads * rotary_pairs
    if conv_state is not None and (conv_weight is None or conv_state.shape != (num_seqs, conv_k - 1, channels)):
        raise ValueError(f"conv_state {tuple(conv_state.shape)} disagrees with {num_seqs} sequences, "
                         f"{None if conv_weight is None else conv_k} taps and {channels} channels")
    return num_seqs, conv_k



def phase_increment_backward_triton(
    grad_increment: torch.Tensor,
    x: torch.Tensor,
    down: torch.Tensor,
    up: torch.Tensor,
    conv_weight: torch.Tensor | None = None,
    conv_activation: str | None = None,
    bias: torch.Tensor | None = None,
    gate_weight: torch.Tensor | None = None,
    gate_bias: torch.Tensor | None = None,
    lengths: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    conv_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, ...]:
    """The gradients of ``phase_increment_triton``'s increments, recomputing the forward instead of saving it.

    Args:
        grad_increment: ``(B, T, Hk, R)`` the gradient of the increments (ignored at padding, where they are
            constant zeros).
        The others: as ``phase_increment_triton`` took them. ``conv_state`` is a constant here (no gradient).

    Returns:
        ``(dx, d_down, d_up, d_conv_weight, d_bias, d_gate_weight, d_gate_bias)``: ``dx`` ``(B, T, Hk * Dc)`` in
        ``x``'s dtype (zero at padding), each weight's gradient in its own shape and dtype, ``None`` for an absent
        input. Computed in float64 and rounded once, as autograd through ``SelectiveRotaryEmbedding.phase_increment``
        computes them (its final rounding to float32 has derivative 1).
    """
    num_seqs, conv_k = _check_phase_inputs(grad_increment, x, down, up, conv_weight, conv_activation, bias,
                                           gate_weight, gate_bias, lengths, cu_seqlens, conv_state)
    return _increment_backward(grad_increment, x, down, up, conv_weight, conv_activation == "silu", bias, gate_weight,
                               gate_bias, lengths, cu_seqlens, conv_state, num_seqs, conv_k)


class WalkSums(NamedTuple):
    """What the rotary backward's first walk leaves for the phase backward to finish, in the fused op from the input
    (``rotary_triton._backward_walks(fused=True)``): its sums ``(N * Hk, 2 chunks + 1, R)`` float32, the plan's
    ``chunks`` of ``chunk`` tokens, and the outputs the phase backward writes: ``dtemp`` ``(R,)`` float32 and, with
    several chunks, ``dinit`` ``(N, Hk, R)`` float64."""

    sums: torch.Tensor
    chunk: int
    chunks: int
    dinit: torch.Tensor
    dtemp: torch.Tensor


def _increment_backward(grad_increment, x, down, up, conv_weight, silu: bool, bias, gate_weight, gate_bias, lengths,
                        cu_seqlens, conv_state, num_seqs: int, conv_k: int,
                        walks: WalkSums | None = None) -> tuple[torch.Tensor | None, ...]:
    """``phase_increment_backward_triton`` of checked inputs; with ``walks``, ``grad_increment`` is the rotary
    backward's, each chunk walked back alone, and the launch also finishes the rotary walks (``WalkSums``)."""
    batch, seq_len, hidden = x.shape
    num_key_heads, rank, chunk_dim = down.shape
    rotary_pairs = up.shape[1]
    has_bias, has_gate = bias is not None, gate_weight is not None
    inputs = (down, up, conv_weight, bias, gate_weight, gate_bias)
    grads = [None if t is None else torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in inputs]
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    # (never with walks: the fused op leaves empty calls to the unfused path)
    if num_seqs == 0 or grad_increment.numel() == 0 or x.numel() == 0:
        return dx.zero_(), *(None if g is None else g.zero_() for g in grads)
    # the kernel's layout of its float64 accumulators, then the count of finished programs
    accumulators = (num_key_heads * rank * chunk_dim + num_key_heads * rotary_pairs * (rank + conv_k + has_bias)
                    + has_gate * num_key_heads * (hidden + 1))
    workspace = torch.zeros(accumulators + 1, dtype=torch.float64, device=x.device)
    halo = max(conv_k - 1, 0)
    block_e = max(_BACKWARD_BLOCK_T, _next_power_of_2(4 * halo))  # (halos at most half the block)
    if x.stride(-1) != 1:
        x = x.contiguous()
    placeholder = workspace  # for pointers a disabled branch never reads
    if lengths is not None and lengths.dtype not in (torch.int32, torch.int64):
        lengths = lengths.long()
    later = walks is not None and walks.chunks > 1
    grid = (num_seqs * (1 if has_gate else num_key_heads), max(_cdiv(seq_len, block_e - 2 * halo), 1))
    _phase_increment_bwd_kernel[grid](
        _dense(grad_increment), x, _dense(down), _dense(up),
        *(placeholder if t is None else _dense(t)
          for t in (conv_weight, bias, gate_weight, gate_bias, lengths, cu_seqlens, conv_state)),
        dx, *(placeholder if g is None else g for g in grads), workspace,
        *((placeholder,) * 3 if walks is None else (walks.sums, walks.dinit, walks.dtemp)),
        seq_len, num_key_heads, rotary_pairs, chunk_dim, rank, 1 if walks is None else walks.chunks,
        seq_len if walks is None else walks.chunk, x.stride(0), x.stride(1),
        CONV_K=conv_k, SILU=conv_k > 0 and silu, HAS_BIAS=has_bias, HAS_GATE=has_gate,
        HAS_LENGTHS=lengths is not None, IS_VARLEN=cu_seqlens is not None, HAS_STATE=conv_state is not None,
        HALO=halo, WALK_SUMS=walks is not None, LATER=later, BLOCK_E=block_e,
        BLOCK_D=min(max(_next_power_of_2(chunk_dim), 16), _BACKWARD_BLOCK_D),
        BLOCK_RANK=max(_next_power_of_2(rank), 16),
        BLOCK_R=min(max(_next_power_of_2(rotary_pairs), 16), _BACKWARD_BLOCK_R),
        BLOCK_H=max(_next_power_of_2(num_key_heads), 16), BLOCK_COPY=_COPY_BLOCK,
        BLOCK_TEMP=max(_next_power_of_2(rotary_pairs), 16), num_warps=8, num_stages=2,
    )
    return dx, *grads
