"""Selective RoPE in Triton: the fused cumulative phase + rotation (forward and backward) and the fused decode step.

Same semantics as the PyTorch reference (:func:`selective_rope.kernels.rotary_torch.selective_rotary` and, for one
token with a cache, ``SelectiveRotaryEmbedding``'s torch path), plus packed sequences (``cu_seqlens``).

**Prefill / training** (``selective_rotary_triton``). A two-pass scan over time chunks. The grid is (sequence x key
head, block of frequency pairs, time chunk); the chunks are as long as fills the GPU (``_plan``: one chunk per
sequence when the sequences alone fill it). Pass 1 sums each chunk's increments (float64); pass 2 starts each chunk
from the initial phase plus the totals of the chunks before it (summed in the kernel, ``_carry``) and walks its chunk
in tiles with a running carry of the phase:

    θ_t = θ_0 + Σ_{s<=t} c_s,   angle_t = τ · θ_t,   (x_i, x_{i+R}) -> (x_i cos − x_{i+R} sin, x_i sin + x_{i+R} cos)

for the key head and every query head of its group (GPT-NeoX halves; dims ``>= 2R`` pass through). ``R`` is the
number of frequency pairs, ``rotary_dim // 2``: ``rotary_pairs`` in the Python code, as in the rest of the library,
and ``R`` in the kernels' arguments, next to their other shape letters (``T``, ``Hk``, ``G``, ``D``).
Backward, same grid, one or two kernels: a forward walk over each chunk (from pass 1's starting phases) recomputes
the phase, writes ``dq``/``dk`` (the inverse rotation of the incoming gradients) and the per-position
``dθ_t = τ · Σ_heads (dy_2 · y_1 − dy_1 · y_2)`` (summed over the query heads of the group inside the program) and
the chunk's Σ dθ; then a reverse walk over each chunk turns ``dθ`` into ``d(increment)_s = Σ_{t>=s} dθ_t
(+ d final phase)``, starting from the later chunks' sums: in the same program, after a barrier, where each
sequence is one chunk (one launch), else in a second kernel that sums the later chunks' slots itself (the fused op
from the input walks each chunk back alone and leaves the later chunks' sums to its phase backward, which reads
every token's ``d(increment)`` anyway: one launch there too). ``d(initial_phase)`` is the total (written by chunk
0's program) and ``d(temperature)`` is reduced from per-chunk partials (in PyTorch, or by the fused op's phase
backward; no atomics).

**Decode** (``selective_rotary_decode_triton``): one token per row, one program per (row, key head). From the phase
projection ``a`` it does SPEC §3 steps 3-8 in training order: the causal convolution over the cached history (then
its activation), ``+ exp(b)``, ``* sigmoid(gate)``, the phase update (float64) and the rotation of q and k, and
writes the new phase and convolution history.
A row whose token is padding adds 0 to its phase and keeps its convolution history, as the torch path does.
Steps 1-2 (the input chunks' normalisation, the projection and the gate's logits) are the model's modules, called
as such where hooks or adapters observe them; for the default phase path with nothing observing,
``selective_rotary_decode_from_input_triton`` computes them in the same launch (on a GPU each small op costs host
time in every layer of every step).

Precision, as in the torch path (see ``rotary_torch``): the phase is summed in float64 (the scan inside a tile too: a
float32 scan over 64 tokens is off by up to ~5e-5 rad, which decoding would not reproduce), every angle is reduced
modulo 2π in float64 (``_angle``) before sin/cos in float32, and the decode step computes the increment in float64
and rounds it to float32 as the torch path does. That is ~10 float64 operations per element against ~20 bytes of
memory traffic. Measured on an H200 (where float64 runs at half the float32 rate; benchmarks/results/gpu/): the
forward reached at most 28 % of the memory bandwidth (run 3); the tiles were chosen by timing them (``_config``).

Both are ``torch.library`` custom ops (``selective_rope::rotary_forward`` / ``rotary_backward`` / ``rotary_decode``,
with fake implementations, the forward with a registered autograd formula), so ``torch.compile`` treats them as
opaque calls instead of breaking the graph.

Runs on CUDA, and on CPU under ``TRITON_INTERPRET=1`` (how the tests check it against the torch reference).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

# Inside try/except: transformers' remote-code loader requires every library a shipped file imports outside such
# blocks, and this file travels with saved models while triton is optional (the caller falls back to torch).
try:
    import triton
    import triton.language as tl
except ImportError as error:
    raise ImportError("the Triton Selective RoPE kernels need `triton` (pip install triton)") from error

__all__ = [
    "selective_rotary_decode_from_input_triton",
    "selective_rotary_decode_triton",
    "selective_rotary_triton",
]

_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


# Host-side arithmetic in plain Python: triton.cdiv and triton.next_power_of_2 go through Triton's constexpr
# machinery, ~2-4 us a call, and a call of the op made seven of them (measured on CPU with the launches stubbed).
def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _config(rotary_pairs: int, pass_dims: int) -> dict[str, int]:
    """One fixed configuration (no autotuning): tiles of 32 tokens x 32 frequency pairs, 4 warps.

    Measured on an H200 (run 4, ``benchmarks/results/gpu/2026-11-27-h200``: ``benchmarks/sweep_rotary_gpu.py``,
    bf16, 16 heads of 128, R = 64, do_bench medians): 32 x 32 with 4 warps was the fastest forward + backward at
    B=8, T=8k (2.45 ms) and within 10-20 % of the best at B=1, T=32k (1.5-1.7 ms against 32 x 64's 1.4), where
    32 x 64 was 7 % slower at B=8, T=8k. 8 warps were slower in every tile shape (16 x 32 with 8 warps, chosen before
    from the compiler's resource report because it spills nothing, took 2.15 and 3.93 ms): spilling
    (``benchmarks/triton_resources.py``) is not what bounds these kernels.

    ``NUM_STAGES``: the software pipelining of the rotation's tile loop (forward and backward walk 1). With 2 or 3
    Triton prefetches the next tiles' increments, k and q into shared memory (``cp.async``) while this one is
    computed; they compile for sm_90a without spills (``benchmarks/triton_resources.py --sweep``). 1 (no prefetch,
    the loop as run 4 timed it) until a GPU sweep has timed them (``sweep_rotary_gpu.py`` includes them).
    """
    block_r = max(1, min(_next_power_of_2(max(rotary_pairs, 1)), 32))
    block_p = max(1, min(_next_power_of_2(max(pass_dims, 1)), 64))
    return {"BLOCK_T": 32, "BLOCK_R": block_r, "BLOCK_P": block_p, "NUM_STAGES": 1, "num_warps": 4}


# Scans and reductions use our own combine function, and zeros come from ``tl.full``: ``tl.cumsum``, ``tl.sum``,
# ``tl.zeros`` and ``tl.cdiv`` are ``@triton.jit`` functions of triton's standard library, bound when triton is
# imported, so under the interpreter they fail ("Cannot call @triton.jit'd outside of the scope of a kernel")
# whenever triton was imported before ``TRITON_INTERPRET=1`` was set. Ours follow the setting at this module's import.
@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _cumsum(x, REVERSE: tl.constexpr):
    return tl.associative_scan(x, 0, _add, reverse=REVERSE)


@triton.jit
def _sum0(x):
    return tl.reduce(x, 0, _add)


@triton.jit
def _turns_per_phase(temp_ptr, rs, mask_r):
    """``τ / 2π`` in float64, as ``rotary_torch.rotary_angles`` computes it. The float64 2π is made by ``tl.full``
    (a bare float literal in a Triton kernel is float32; ``tl.full`` keeps all 64 bits of it, the PTX holds
    ``0d401921FB54442D18``), not read from memory: one launch argument less per kernel."""
    two_pi = tl.full([], 6.283185307179586, tl.float64)
    return tl.load(temp_ptr + rs, mask=mask_r, other=0.0).to(tl.float64) / two_pi


@triton.jit
def _angle(phase, turns_per_phase):
    """``τ θ`` reduced mod 2π: float64 ``phase`` and ``τ / 2π`` in, float32 angle in (-2π, 2π) out, computed as
    ``rotary_torch.rotary_angles`` does: the turns minus their integer part toward zero (``torch.frac``), then the 2π
    factor in float32. The integer part is rounded in float64 (``floor`` of the magnitude: one ``cvt.rmi.f64.f64``),
    not through 64-bit integers (a float64 -> int64 -> float64 round trip, two slow conversions per element): the
    same value for every float64."""
    turns = phase * turns_per_phase
    whole = tl.floor(tl.abs(turns))
    return (turns - tl.where(turns < 0, -whole, whole)).to(tl.float32) * 6.283185307179586


@triton.jit
def _sincos(angle):
    """``(sin, cos)`` of a float32 angle in (-2π, 2π): what ``tl.sin`` and ``tl.cos`` give on a GPU (libdevice's
    ``sinf`` / ``cosf``), bit for bit, with one range reduction for both instead of two and without their slow path.
    Each of those reduces by π/2 in three fma steps, unless ``|x| >= 105615``, where a Payne-Hanek reduction in local
    memory runs instead: never here, but it held a stack frame and registers in every tile loop. The constants are
    libdevice's (read from the PTX Triton 3.6 and 3.9 emit for ``tl.sin``), every step an fma as there, the quadrant
    rounded half to even as its ``cvt.rni``. One difference: libdevice flushes a subnormal angle (below 2^-126) to
    zero, this keeps it. The interpreter runs it too: the CPU tests see the GPU's arithmetic, not numpy's sin."""
    # q = rint(angle * 2/π): the product rounded first (an fma with a zero addend, so the compiler cannot fuse it into
    # the rounding's addition), then to an integer by adding and subtracting 1.5 * 2^23 (exact for |q| < 2^22)
    q = (tl.fma(angle, 0.636619747, 0.0) + 12582912.0) - 12582912.0
    r = tl.fma(q, -1.57079625, angle)  # angle - q π/2, π/2 in three parts
    r = tl.fma(q, -7.54978942e-08, r)
    r = tl.fma(q, -5.39030295e-15, r)
    r2 = r * r
    odd = q.to(tl.int32)
    sine = tl.fma(tl.fma(tl.fma(-0.000195746587, r2, 0.00833270326), r2, -0.166666627), tl.fma(r2, r, 0.0), r)
    cosine = tl.fma(tl.fma(tl.fma(tl.fma(2.42795795e-05, r2, -0.00138878601), r2, 0.0416667275), r2, -0.49999997),
                    r2, 1.0)
    sin = tl.where((odd & 1) != 0, cosine, sine)
    cos = tl.where((odd & 1) != 0, sine, cosine)
    # the sign of quadrants 2-3 (cos: of the next quadrant), as libdevice's fma(x, -1, 0): 0 - x, +0 for x = 0
    sin = tl.where((odd & 2) != 0, 0.0 - sin, sin)
    cos = tl.where(((odd + 1) & 2) != 0, 0.0 - cos, cos)
    return sin, cos


@triton.jit
def _span(n, cu_ptr, T, IS_VARLEN: tl.constexpr):
    """(batch row, first token, end token) of sequence ``n``."""
    if IS_VARLEN:
        bos = tl.load(cu_ptr + n).to(tl.int64)
        eos = tl.load(cu_ptr + n + 1).to(tl.int64)
        b = n * 0
    else:
        bos = n.to(tl.int64) * 0
        eos = bos + T
        b = n
    return b.to(tl.int64), bos, eos


@triton.jit
def _chunk_program(cu_ptr, T, Hk, R, CHUNK, IS_VARLEN: tl.constexpr, BLOCK_R: tl.constexpr):
    """What a program of the prefill grid (sequence x key head, block of frequency pairs, time chunk) works on: its
    program ids, key head, batch row, the tokens [start, end) of its chunk (empty past its sequence's end) and its
    frequency pairs ``rs`` with their mask."""
    pid_nh, pid_r, pid_c = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    hk = pid_nh % Hk
    b, bos, eos = _span(pid_nh // Hk, cu_ptr, T, IS_VARLEN)
    start = bos + pid_c.to(tl.int64) * CHUNK
    rs = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    return pid_nh, pid_r, pid_c, hk, b, start, tl.minimum(start + CHUNK, eos), rs, rs < R


@triton.jit
def _carry(carry_ptr, pid_nh, pid_c, CR, R, rs, mask_r, HAS_CARRY: tl.constexpr, BLOCK_R: tl.constexpr):
    """The phase before chunk ``pid_c``, float64: the sum of slots ``0..pid_c`` of a ``(N * Hk, CR, R)`` buffer whose
    slot 0 holds the initial phase and slot ``c + 1`` chunk ``c``'s total (pass 1's; ``CR == 1``: the initial phase
    alone). Summed here, in slot order, rather than by a cumulative sum in PyTorch between the passes: one torch op
    less per pass (the chunks are few, and so are the loads)."""
    carry = tl.full([BLOCK_R], 0.0, tl.float64)
    if HAS_CARRY:
        base = carry_ptr + pid_nh.to(tl.int64) * CR * R + rs
        for slot in range(0, tl.minimum(pid_c + 1, CR)):
            carry += tl.load(base + slot * R, mask=mask_r, other=0.0)
    return carry


@triton.jit
def _chunk_totals_kernel(
    inc_ptr, init_ptr, cu_ptr, sums_ptr,
    T, Hk, R, NC, CHUNK,
    si_b, si_t, si_h, si_r,
    HAS_INIT: tl.constexpr, IS_VARLEN: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """Pass 1 of the chunked scan: the float64 sum of the increments of every (sequence, key head, chunk), summed
    tile by tile as pass 2 carries it, into slot ``chunk + 1`` of a ``(N * Hk, NC + 1, R)`` buffer whose slot 0 gets
    the initial phase: pass 2 sums the slots up to its chunk's (``_carry``) for its starting phase. A chunk past its
    sequence's end sums to 0."""
    pid_nh, pid_r, pid_c, hk, b, start, end, rs, mask_r = _chunk_program(cu_ptr, T, Hk, R, CHUNK, IS_VARLEN, BLOCK_R)
    total = tl.full([BLOCK_R], 0.0, tl.float64)
    inc_base = inc_ptr + b * si_b + hk * si_h
    for t0 in range(start, end, BLOCK_T):
        ts = t0 + tl.arange(0, BLOCK_T)
        mask = (ts < end)[:, None] & mask_r[None, :]
        total += _sum0(tl.load(inc_base + ts[:, None] * si_t + rs[None, :] * si_r, mask=mask, other=0.0)
                       .to(tl.float64))
    row = pid_nh.to(tl.int64) * (NC + 1)
    tl.store(sums_ptr + (row + pid_c + 1) * R + rs, total, mask=mask_r)
    if pid_c == 0:
        if HAS_INIT:
            first = tl.load(init_ptr + pid_nh.to(tl.int64) * R + rs, mask=mask_r, other=0.0)
        else:
            first = tl.full([BLOCK_R], 0.0, tl.float64)
        tl.store(sums_ptr + row * R + rs, first, mask=mask_r)


@triton.jit
def _copy_pass_through(x_ptr, o_ptr, b, h0, heads, start, end, R, D, sx_b, sx_t, sx_h, sx_d, so_b, so_t, so_h, so_d,
                       BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr):
    """Copy the dims ``>= 2R`` (no frequency rotates them) of tokens [start, end) of heads [h0, h0 + heads) of batch
    row ``b`` from ``x`` to ``o``, in ``o``'s dtype. Its own loop, after the rotation's: inside that loop its tiles
    and pointers were live registers in every tile of every program, for a copy only one program in R's blocks does."""
    for h in range(h0, h0 + heads):
        x_base = x_ptr + b * sx_b + h * sx_h
        o_base = o_ptr + b * so_b + h * so_h
        for t0 in range(start, end, BLOCK_T):
            ts = t0 + tl.arange(0, BLOCK_T)
            for p0 in range(2 * R, D, BLOCK_P):
                ds = p0 + tl.arange(0, BLOCK_P)
                mask = (ts < end)[:, None] & (ds < D)[None, :]
                x = tl.load(x_base + ts[:, None] * sx_t + ds[None, :] * sx_d, mask=mask, other=0.0)
                tl.store(o_base + ts[:, None] * so_t + ds[None, :] * so_d, x.to(o_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _selective_rotary_fwd_kernel(
    q_ptr, k_ptr, inc_ptr, temp_ptr, carry_ptr, oq_ptr, ok_ptr, final_ptr, cu_ptr,
    T, Hk, G, R, D, NC, CR, CHUNK,
    sq_b, sq_t, sq_h, sq_d,
    sk_b, sk_t, sk_h, sk_d,
    soq_b, soq_t, soq_h, soq_d,
    sok_b, sok_t, sok_h, sok_d,
    si_b, si_t, si_h, si_r,
    HAS_CARRY: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_PASS: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    pid_nh, pid_r, pid_c, hk, b, start, end, rs, mask_r = _chunk_program(cu_ptr, T, Hk, R, CHUNK, IS_VARLEN, BLOCK_R)
    turns = _turns_per_phase(temp_ptr, rs, mask_r)
    carry = _carry(carry_ptr, pid_nh, pid_c, CR, R, rs, mask_r, HAS_CARRY, BLOCK_R)

    inc_base = inc_ptr + b * si_b + hk * si_h
    k_base = k_ptr + b * sk_b + hk * sk_h
    ok_base = ok_ptr + b * sok_b + hk * sok_h
    for t0 in tl.range(start, end, BLOCK_T, num_stages=NUM_STAGES):
        ts = t0 + tl.arange(0, BLOCK_T)
        mask_t = ts < end
        mask = mask_t[:, None] & mask_r[None, :]
        inc = tl.load(inc_base + ts[:, None] * si_t + rs[None, :] * si_r, mask=mask, other=0.0).to(tl.float64)
        phase = _cumsum(inc, False) + carry[None, :]
        carry += _sum0(inc)
        sin, cos = _sincos(_angle(phase, turns[None, :]))

        # key head
        p1 = k_base + ts[:, None] * sk_t + rs[None, :] * sk_d
        x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(p1 + R * sk_d, mask=mask, other=0.0).to(tl.float32)
        o1 = ok_base + ts[:, None] * sok_t + rs[None, :] * sok_d
        tl.store(o1, (x1 * cos - x2 * sin).to(ok_ptr.dtype.element_ty), mask=mask)
        tl.store(o1 + R * sok_d, (x1 * sin + x2 * cos).to(ok_ptr.dtype.element_ty), mask=mask)
        # the query heads of its group
        for g in range(G):
            hq = hk * G + g
            p1 = q_ptr + b * sq_b + hq * sq_h + ts[:, None] * sq_t + rs[None, :] * sq_d
            x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
            x2 = tl.load(p1 + R * sq_d, mask=mask, other=0.0).to(tl.float32)
            o1 = oq_ptr + b * soq_b + hq * soq_h + ts[:, None] * soq_t + rs[None, :] * soq_d
            tl.store(o1, (x1 * cos - x2 * sin).to(oq_ptr.dtype.element_ty), mask=mask)
            tl.store(o1 + R * soq_d, (x1 * sin + x2 * cos).to(oq_ptr.dtype.element_ty), mask=mask)

    if HAS_PASS:  # dims >= 2R: copied by the first frequency block only, outside the rotation's tile loop
        if pid_r == 0:
            _copy_pass_through(k_ptr, ok_ptr, b, hk, 1, start, end, R, D, sk_b, sk_t, sk_h, sk_d,
                               sok_b, sok_t, sok_h, sok_d, BLOCK_T, BLOCK_P)
            _copy_pass_through(q_ptr, oq_ptr, b, hk * G, G, start, end, R, D, sq_b, sq_t, sq_h, sq_d,
                               soq_b, soq_t, soq_h, soq_d, BLOCK_T, BLOCK_P)

    if pid_c == NC - 1:  # the last chunk (of the longest sequence: past a shorter one's end, it carries its total)
        tl.store(final_ptr + pid_nh.to(tl.int64) * R + rs, carry, mask=mask_r)


@triton.jit
def _selective_rotary_bwd_kernel(
    q_ptr, k_ptr, dyq_ptr, dyk_ptr, inc_ptr, temp_ptr, carry_ptr, dfinal_ptr, cu_ptr,
    dq_ptr, dk_ptr, dinc_ptr, dsums_ptr, dinit_ptr,
    T, Hk, G, R, D, NC, CR, CHUNK,
    sq_b, sq_t, sq_h, sq_d,
    sk_b, sk_t, sk_h, sk_d,
    sdyq_b, sdyq_t, sdyq_h, sdyq_d,
    sdyk_b, sdyk_t, sdyk_h, sdyk_d,
    sdq_b, sdq_t, sdq_h, sdq_d,
    sdk_b, sdk_t, sdk_h, sdk_d,
    si_b, si_t, si_h, si_r,
    sdi_b, sdi_t, sdi_h,
    HAS_CARRY: tl.constexpr, HAS_DFINAL: tl.constexpr, NEED_DTEMP: tl.constexpr, IS_VARLEN: tl.constexpr,
    HAS_PASS: tl.constexpr, WALK_BACK: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    """Backward walk 1, forward in time over one chunk: recompute the phase exactly as the forward did, rotate the
    gradients back, and write dθ_t (summed over the key head and its query heads) into the d(increment) buffer. Its
    sums go to a ``(N * Hk, 2 NC + 1, R)`` buffer (``_backward_walks``'): the chunk's Σ dθ to slot ``NC - chunk``, the
    final phase's gradient to slot 0 (so that summing slots gives what reaches each chunk from later in time), and its
    Σ θ dangle (for d temperature) to slot ``NC + 1 + chunk``. With one chunk a sequence it also does walk 2; with
    several and ``WALK_BACK`` (the fused op) it walks its chunk back alone, from zero: what reaches the chunk from
    later in time is then the reader's to add (``phase_triton``'s backward adds it to every token it reads)."""
    pid_nh, pid_r, pid_c, hk, b, start, end, rs, mask_r = _chunk_program(cu_ptr, T, Hk, R, CHUNK, IS_VARLEN, BLOCK_R)
    temp = tl.load(temp_ptr + rs, mask=mask_r, other=0.0).to(tl.float32)
    turns = _turns_per_phase(temp_ptr, rs, mask_r)
    carry = _carry(carry_ptr, pid_nh, pid_c, CR, R, rs, mask_r, HAS_CARRY, BLOCK_R)
    dphase_total = tl.full([BLOCK_R], 0.0, tl.float32)
    dtemp_acc = tl.full([BLOCK_R], 0.0, tl.float64)  # Σ θ_t dangle_t: θ is large, keep its bits

    inc_base = inc_ptr + b * si_b + hk * si_h
    dinc_base = dinc_ptr + b * sdi_b + hk * sdi_h
    for t0 in tl.range(start, end, BLOCK_T, num_stages=NUM_STAGES):
        ts = t0 + tl.arange(0, BLOCK_T)
        mask_t = ts < end
        mask = mask_t[:, None] & mask_r[None, :]
        inc = tl.load(inc_base + ts[:, None] * si_t + rs[None, :] * si_r, mask=mask, other=0.0).to(tl.float64)
        phase = _cumsum(inc, False) + carry[None, :]
        carry += _sum0(inc)
        sin, cos = _sincos(_angle(phase, turns[None, :]))

        # key head: y = rot(x); dangle = dy2 * y1 - dy1 * y2; dx = rot(-angle)(dy)
        p1 = k_ptr + b * sk_b + hk * sk_h + ts[:, None] * sk_t + rs[None, :] * sk_d
        x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(p1 + R * sk_d, mask=mask, other=0.0).to(tl.float32)
        g1 = dyk_ptr + b * sdyk_b + hk * sdyk_h + ts[:, None] * sdyk_t + rs[None, :] * sdyk_d
        dy1 = tl.load(g1, mask=mask, other=0.0).to(tl.float32)
        dy2 = tl.load(g1 + R * sdyk_d, mask=mask, other=0.0).to(tl.float32)
        dangle = dy2 * (x1 * cos - x2 * sin) - dy1 * (x1 * sin + x2 * cos)
        o1 = dk_ptr + b * sdk_b + hk * sdk_h + ts[:, None] * sdk_t + rs[None, :] * sdk_d
        tl.store(o1, (dy1 * cos + dy2 * sin).to(dk_ptr.dtype.element_ty), mask=mask)
        tl.store(o1 + R * sdk_d, (dy2 * cos - dy1 * sin).to(dk_ptr.dtype.element_ty), mask=mask)
        for g in range(G):
            hq = hk * G + g
            p1 = q_ptr + b * sq_b + hq * sq_h + ts[:, None] * sq_t + rs[None, :] * sq_d
            x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
            x2 = tl.load(p1 + R * sq_d, mask=mask, other=0.0).to(tl.float32)
            g1 = dyq_ptr + b * sdyq_b + hq * sdyq_h + ts[:, None] * sdyq_t + rs[None, :] * sdyq_d
            dy1 = tl.load(g1, mask=mask, other=0.0).to(tl.float32)
            dy2 = tl.load(g1 + R * sdyq_d, mask=mask, other=0.0).to(tl.float32)
            dangle += dy2 * (x1 * cos - x2 * sin) - dy1 * (x1 * sin + x2 * cos)
            o1 = dq_ptr + b * sdq_b + hq * sdq_h + ts[:, None] * sdq_t + rs[None, :] * sdq_d
            tl.store(o1, (dy1 * cos + dy2 * sin).to(dq_ptr.dtype.element_ty), mask=mask)
            tl.store(o1 + R * sdq_d, (dy2 * cos - dy1 * sin).to(dq_ptr.dtype.element_ty), mask=mask)

        dphase = dangle * temp[None, :]
        dphase_total += _sum0(dphase)
        if NEED_DTEMP:
            dtemp_acc += _sum0(tl.where(mask, phase * dangle.to(tl.float64), 0.0))
        tl.store(dinc_base + ts[:, None] * sdi_t + rs[None, :], dphase, mask=mask)

    if HAS_PASS:  # pass-through dims: the gradient is copied by the first frequency block only
        if pid_r == 0:
            _copy_pass_through(dyk_ptr, dk_ptr, b, hk, 1, start, end, R, D, sdyk_b, sdyk_t, sdyk_h, sdyk_d,
                               sdk_b, sdk_t, sdk_h, sdk_d, BLOCK_T, BLOCK_P)
            _copy_pass_through(dyq_ptr, dq_ptr, b, hk * G, G, start, end, R, D, sdyq_b, sdyq_t, sdyq_h, sdyq_d,
                               sdq_b, sdq_t, sdq_h, sdq_d, BLOCK_T, BLOCK_P)

    row = pid_nh.to(tl.int64) * (2 * NC + 1)
    tl.store(dsums_ptr + (row + NC + 1 + pid_c) * R + rs, dtemp_acc.to(tl.float32), mask=mask_r)  # 0 unless NEED_DTEMP
    if HAS_DFINAL:
        last = tl.load(dfinal_ptr + pid_nh.to(tl.int64) * R + rs, mask=mask_r, other=0.0)
    else:
        last = tl.full([BLOCK_R], 0.0, tl.float32)
    if NC == 1:
        # One chunk a sequence (a plan whose programs fill the device): walk 2 here, not in a second launch, and
        # d initial phase (d final phase + the chunk's Σ dθ, summed as the suffix kernel sums the slots).
        tl.store(dinit_ptr + pid_nh.to(tl.int64) * R + rs, (last + dphase_total).to(tl.float64), mask=mask_r)
        tl.debug_barrier()  # this program's dθ stores, seen by all its threads
        _suffix_walk(dinc_base, last, start, end, sdi_t, rs, mask_r, BLOCK_T)
    else:
        tl.store(dsums_ptr + (row + NC - pid_c) * R + rs, dphase_total, mask=mask_r)
        if pid_c == 0:
            tl.store(dsums_ptr + row * R + rs, last, mask=mask_r)
        if WALK_BACK:  # the chunk alone: the later chunks' sums are added where d(increment) is read
            tl.debug_barrier()
            _suffix_walk(dinc_base, tl.full([BLOCK_R], 0.0, tl.float32), start, end, sdi_t, rs, mask_r, BLOCK_T)


@triton.jit
def _suffix_sum_kernel(
    dinc_ptr, dsums_ptr, cu_ptr, dinit_ptr,
    T, Hk, R, NC, CHUNK,
    sdi_b, sdi_t, sdi_h,
    IS_VARLEN: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """Backward walk 2 over one chunk of several (with one, the backward kernel walks it): ``_suffix_walk`` from what
    reaches the chunk from later in time, summed here from walk 1's slots (no cumulative sum in PyTorch between the
    walks); chunk 0's program writes the initial phase's gradient, the sum of every slot (float64 ``(N * Hk, R)``)."""
    pid_nh, pid_r, pid_c, hk, b, start, end, rs, mask_r = _chunk_program(cu_ptr, T, Hk, R, CHUNK, IS_VARLEN, BLOCK_R)
    # slots 0 .. NC - 1 - chunk, in slot order: d final phase + Σ dθ of the chunks after this one
    slots = dsums_ptr + pid_nh.to(tl.int64) * (2 * NC + 1) * R + rs
    suffix = tl.full([BLOCK_R], 0.0, tl.float32)
    for slot in range(0, NC - pid_c):
        suffix += tl.load(slots + slot * R, mask=mask_r, other=0.0)
    if pid_c == 0:
        total = suffix + tl.load(slots + NC * R, mask=mask_r, other=0.0)
        tl.store(dinit_ptr + pid_nh.to(tl.int64) * R + rs, total.to(tl.float64), mask=mask_r)
    _suffix_walk(dinc_ptr + b * sdi_b + hk * sdi_h, suffix, start, end, sdi_t, rs, mask_r, BLOCK_T)


@triton.jit
def _suffix_walk(dinc_base, suffix, start, end, sdi_t, rs, mask_r, BLOCK_T: tl.constexpr):
    """Reverse in time over tokens [start, end), in place over the dθ buffer:
    d(increment)_s = Σ_{t>=s in [start, end)} dθ_t + suffix (Σ dθ of the later chunks + d final phase)."""
    num_tiles = tl.maximum(end - start + BLOCK_T - 1, 0) // BLOCK_T
    for i in range(0, num_tiles):
        ts = start + (num_tiles - 1 - i) * BLOCK_T + tl.arange(0, BLOCK_T)
        mask = (ts < end)[:, None] & mask_r[None, :]
        ptrs = dinc_base + ts[:, None] * sdi_t + rs[None, :]
        dphase = tl.load(ptrs, mask=mask, other=0.0)
        tl.store(ptrs, _cumsum(dphase, True) + suffix[None, :], mask=mask)
        suffix += _sum0(dphase)


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _rotate_head(x_ptr, o_ptr, rs, mask_r, cos, sin, R, D, s_d, so_d,
                 HAS_PASS: tl.constexpr, BLOCK_P: tl.constexpr):
    """Rotate one head vector (the first 2R dims in GPT-NeoX halves) and copy the dims >= 2R."""
    x1 = tl.load(x_ptr + rs * s_d, mask=mask_r, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + (rs + R) * s_d, mask=mask_r, other=0.0).to(tl.float32)
    tl.store(o_ptr + rs * so_d, (x1 * cos - x2 * sin).to(o_ptr.dtype.element_ty), mask=mask_r)
    tl.store(o_ptr + (rs + R) * so_d, (x1 * sin + x2 * cos).to(o_ptr.dtype.element_ty), mask=mask_r)
    if HAS_PASS:
        for p0 in range(2 * R, D, BLOCK_P):
            ds = p0 + tl.arange(0, BLOCK_P)
            x = tl.load(x_ptr + ds * s_d, mask=ds < D, other=0.0)
            tl.store(o_ptr + ds * so_d, x.to(o_ptr.dtype.element_ty), mask=ds < D)


# Two decode kernels around one body (``_decode_steps``), not one kernel with a constexpr switch: each launch passes
# only its own inputs' arguments, and on a GPU host every argument Triton binds costs time in every decoding step.
@triton.jit
def _selective_rotary_decode_kernel(
    q_ptr, k_ptr, proj_ptr, gate_ptr,
    temp_ptr, phase_ptr, conv_ptr, weight_ptr, bias_ptr, valid_ptr,
    oq_ptr, ok_ptr, ophase_ptr, oconv_ptr,
    Hk, G, R, D,
    sq_b, sq_h, sq_d,
    sk_b, sk_h, sk_d,
    soq_b, soq_h, soq_d,
    sok_b, sok_h, sok_d,
    sp_b, sp_h, sp_r,
    sg_b, sg_h, sg_r,
    CONV_K: tl.constexpr, SILU: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_GATE: tl.constexpr,
    HAS_VALID: tl.constexpr, HAS_PASS: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
):
    """One decoding step from the phase inputs (step 2's projection and the gate's logits, given)."""
    pid = tl.program_id(0).to(tl.int64)  # (row b, key head hk) of a contiguous (B, Hk, R) phase
    b = pid // Hk
    hk = pid % Hk
    rs = tl.arange(0, BLOCK_R)
    mask_r = rs < R
    a = tl.load(proj_ptr + b * sp_b + hk * sp_h + rs * sp_r, mask=mask_r, other=0.0).to(tl.float64)
    gate = a  # (unused without a gate)
    if HAS_GATE:
        gate = tl.load(gate_ptr + b * sg_b + hk * sg_h + rs * sg_r, mask=mask_r, other=0.0).to(tl.float64)
    _decode_steps(
        a, gate, pid, b, hk, rs, mask_r,
        q_ptr, k_ptr, temp_ptr, phase_ptr, conv_ptr, weight_ptr, bias_ptr, valid_ptr,
        oq_ptr, ok_ptr, ophase_ptr, oconv_ptr,
        Hk, G, R, D, sq_b, sq_h, sq_d, sk_b, sk_h, sk_d, soq_b, soq_h, soq_d, sok_b, sok_h, sok_d,
        CONV_K, SILU, HAS_BIAS, HAS_GATE, HAS_VALID, HAS_PASS, BLOCK_R, BLOCK_P,
    )


@triton.jit
def _selective_rotary_decode_from_input_kernel(
    q_ptr, k_ptr, x_ptr, down_ptr, up_ptr, gw_ptr, gb_ptr,
    temp_ptr, phase_ptr, conv_ptr, weight_ptr, bias_ptr, valid_ptr,
    oq_ptr, ok_ptr, ophase_ptr, oconv_ptr,
    Hk, G, R, D,
    sq_b, sq_h, sq_d,
    sk_b, sk_h, sk_d,
    soq_b, soq_h, soq_d,
    sok_b, sok_h, sok_d,
    Dc, RANK, sx_b,
    CONV_K: tl.constexpr, SILU: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_GATE: tl.constexpr,
    HAS_VALID: tl.constexpr, HAS_PASS: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_RANK: tl.constexpr,
):
    """One decoding step from this step's input ``x``: steps 1-2 of the default phase path (``_low_rank_projection``,
    ``_per_head_gate_logit``), then the same steps as ``_selective_rotary_decode_kernel``."""
    pid = tl.program_id(0).to(tl.int64)  # (row b, key head hk) of a contiguous (B, Hk, R) phase
    b = pid // Hk
    hk = pid % Hk
    rs = tl.arange(0, BLOCK_R)
    mask_r = rs < R
    row = x_ptr + b * sx_b
    a = _low_rank_projection(row, down_ptr, up_ptr, hk, Dc, RANK, R, BLOCK_D, BLOCK_RANK, BLOCK_R)
    gate = a  # (unused without a gate)
    if HAS_GATE:
        gate = _per_head_gate_logit(row, gw_ptr, gb_ptr, hk, Hk, Dc, BLOCK_D)
    _decode_steps(
        a, gate, pid, b, hk, rs, mask_r,
        q_ptr, k_ptr, temp_ptr, phase_ptr, conv_ptr, weight_ptr, bias_ptr, valid_ptr,
        oq_ptr, ok_ptr, ophase_ptr, oconv_ptr,
        Hk, G, R, D, sq_b, sq_h, sq_d, sk_b, sk_h, sk_d, soq_b, soq_h, soq_d, sok_b, sok_h, sok_d,
        CONV_K, SILU, HAS_BIAS, HAS_GATE, HAS_VALID, HAS_PASS, BLOCK_R, BLOCK_P,
    )


@triton.jit
def _decode_steps(
    a, gate, pid, b, hk, rs, mask_r,
    q_ptr, k_ptr, temp_ptr, phase_ptr, conv_ptr, weight_ptr, bias_ptr, valid_ptr,
    oq_ptr, ok_ptr, ophase_ptr, oconv_ptr,
    Hk, G, R, D, sq_b, sq_h, sq_d, sk_b, sk_h, sk_d, soq_b, soq_h, soq_d, sok_b, sok_h, sok_d,
    CONV_K: tl.constexpr, SILU: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_GATE: tl.constexpr,
    HAS_VALID: tl.constexpr, HAS_PASS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
):
    """Steps 3-8 of one decoding step for program (row ``b``, key head ``hk``), from step 2's projection ``a`` and
    the gate's logit(s) ``gate`` (float64; one per head, or one per pair), in float64 as the torch path computes them
    (``SelectiveRotaryEmbedding.phase_increment``), so both round the increment to the same float32 value."""
    if HAS_VALID:  # step 2's output, zeroed for a padding token
        keep = tl.load(valid_ptr + b) != 0
        valid = keep.to(tl.float64)
        a = a * valid

    # Step 3: causal depthwise convolution over (history, a), taps oldest first, summed in the torch path's order.
    c = a
    if CONV_K > 0:
        channels = Hk * R
        ch = hk * R + rs
        history = conv_ptr + b * (CONV_K - 1) * channels + ch  # (B, K-1, Hk*R) contiguous, float64
        new_history = oconv_ptr + b * (CONV_K - 1) * channels + ch
        c = tl.full([BLOCK_R], 0.0, tl.float64)
        for j in tl.static_range(CONV_K - 1):
            h_j = tl.load(history + j * channels, mask=mask_r, other=0.0).to(tl.float64)
            c += h_j * tl.load(weight_ptr + ch * CONV_K + j, mask=mask_r, other=0.0).to(tl.float64)
            # The history moves on by one input, unless the token is padding (then it stays as it was).
            if j + 1 < CONV_K - 1:
                shifted = tl.load(history + (j + 1) * channels, mask=mask_r, other=0.0).to(tl.float64)
            else:
                shifted = a
            if HAS_VALID:
                shifted = tl.where(keep, shifted, h_j)
            tl.store(new_history + j * channels, shifted, mask=mask_r)
        c += a * tl.load(weight_ptr + ch * CONV_K + CONV_K - 1, mask=mask_r, other=0.0).to(tl.float64)
        if SILU:
            c = c * _sigmoid(c)
    # Steps 4-5: bias, then the gate (which scales the bias too), then pads contribute nothing.
    if HAS_BIAS:
        c += tl.exp(tl.load(bias_ptr + hk * R + rs, mask=mask_r, other=0.0).to(tl.float64))
    if HAS_GATE:
        c *= _sigmoid(gate)
    if HAS_VALID:
        c = c * valid

    # Step 6-8: the increment rounded to float32 (as the torch path's), the phase update in float64, the angle reduced
    # mod 2π, the rotation of the key head and of its query heads.
    phase = tl.load(phase_ptr + pid * R + rs, mask=mask_r, other=0.0).to(tl.float64) + c.to(tl.float32).to(tl.float64)
    tl.store(ophase_ptr + pid * R + rs, phase, mask=mask_r)
    sin, cos = _sincos(_angle(phase, _turns_per_phase(temp_ptr, rs, mask_r)))
    _rotate_head(k_ptr + b * sk_b + hk * sk_h, ok_ptr + b * sok_b + hk * sok_h, rs, mask_r, cos, sin, R, D,
                 sk_d, sok_d, HAS_PASS, BLOCK_P)
    for g in range(G):
        hq = hk * G + g
        _rotate_head(q_ptr + b * sq_b + hq * sq_h, oq_ptr + b * soq_b + hq * soq_h, rs, mask_r, cos, sin, R, D,
                     sq_d, soq_d, HAS_PASS, BLOCK_P)


@triton.jit
def _chunk_norm(row_ptr, Dc, BLOCK_D: tl.constexpr):
    """``max(‖x‖, 1e-12)`` of one input chunk, in float64 (``F.normalize``'s denominator)."""
    squares = tl.full([BLOCK_D], 0.0, tl.float64)
    for d0 in range(0, Dc, BLOCK_D):
        ds = d0 + tl.arange(0, BLOCK_D)
        x = tl.load(row_ptr + ds, mask=ds < Dc, other=0.0).to(tl.float64)
        squares += x * x
    # (float64 square roots are correctly rounded on GPUs: PTX has no approximate one, unlike float32's)
    return tl.maximum(tl.sqrt(tl.sum(squares, axis=0)), 1e-12)


@triton.jit
def _low_rank_projection(row, down_ptr, up_ptr, hk, Dc, RANK, R,
                         BLOCK_D: tl.constexpr, BLOCK_RANK: tl.constexpr, BLOCK_R: tl.constexpr):
    """``up_h @ (down_h @ u_h)``, float64 ``[BLOCK_R]``, for the head's input chunk L2-normalised
    (``u = x / max(‖x‖, 1e-12)``): the ``"low_rank"`` ``PhaseProjection`` of one token."""
    ks = tl.arange(0, BLOCK_RANK)
    rs = tl.arange(0, BLOCK_R)
    mask_k = ks < RANK
    mask_r = rs < R
    chunk = row + hk * Dc
    norm = _chunk_norm(chunk, Dc, BLOCK_D)
    low = tl.full([BLOCK_RANK], 0.0, tl.float64)  # down_h @ u_h
    for d0 in range(0, Dc, BLOCK_D):
        ds = d0 + tl.arange(0, BLOCK_D)
        mask_d = ds < Dc
        u = tl.load(chunk + ds, mask=mask_d, other=0.0).to(tl.float64) / norm
        down = tl.load(down_ptr + (hk * RANK + ks[:, None]) * Dc + ds[None, :], mask=mask_k[:, None] & mask_d[None, :],
                       other=0.0).to(tl.float64)
        low += tl.sum(down * u[None, :], axis=1)
    up = tl.load(up_ptr + (hk * R + rs[:, None]) * RANK + ks[None, :], mask=mask_r[:, None] & mask_k[None, :],
                 other=0.0).to(tl.float64)
    return tl.sum(up * low[None, :], axis=1)


@triton.jit
def _per_head_gate_logit(row, gw_ptr, gb_ptr, hk, Hk, Dc, BLOCK_D: tl.constexpr):
    """``w_h · u + b_h`` over every chunk of the row (each normalised by its own norm), float64: the per-head
    ``PhaseLinear`` gate's logit for head ``hk``."""
    hidden = Hk * Dc
    acc = tl.full([BLOCK_D], 0.0, tl.float64)
    for c in range(Hk):
        chunk_c = row + c * Dc
        norm_c = _chunk_norm(chunk_c, Dc, BLOCK_D)
        for d0 in range(0, Dc, BLOCK_D):
            ds = d0 + tl.arange(0, BLOCK_D)
            mask_d = ds < Dc
            u = tl.load(chunk_c + ds, mask=mask_d, other=0.0).to(tl.float64) / norm_c
            acc += tl.load(gw_ptr + hk * hidden + c * Dc + ds, mask=mask_d, other=0.0).to(tl.float64) * u
    return tl.sum(acc, axis=0) + tl.load(gb_ptr + hk).to(tl.float64)


# --------------------------------------------------------------------------------------------------------------------
# custom ops: prefill forward and backward
# --------------------------------------------------------------------------------------------------------------------
def _num_seqs(q: torch.Tensor, cu_seqlens: torch.Tensor | None) -> int:
    return q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1


# Programs wanted in flight on a GPU, per multiprocessor: one program per (sequence, key head) would leave most of an
# H100 idle at batch 1 (16 heads on 132 multiprocessors; measured on an H200: 110 GB/s, a quarter of torch.compile's
# fused cumsum), so long sequences are cut into time chunks that run in parallel (a two-pass scan).
_PROGRAMS_PER_SM = 4
_INTERPRETER_PROGRAMS = 8  # under the interpreter: enough chunks that the CPU tests run the chunked scan


@functools.lru_cache(maxsize=None)
def _multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _chunk_tiles(seq_len: int, num_seqs: int, packed: bool, programs: int, block_t: int,
                 device: torch.device) -> int:
    """Time tiles per chunk. One chunk spanning ``seq_len`` where the ``programs`` (sequences x key heads x
    frequency blocks) fill the device; else as many chunks per sequence as fill it, sized from the mean sequence
    length (``seq_len`` a row, or a packed row's ``seq_len / num_seqs``: a longer packed sequence gets more chunks,
    and programs past a sequence's end return at once)."""
    if device.type == "cuda":
        target = _PROGRAMS_PER_SM * _multiprocessors(device.index if device.index is not None else 0)
    else:
        target = _INTERPRETER_PROGRAMS
    whole = max(1, _cdiv(seq_len, block_t))
    wanted = _cdiv(target, max(programs, 1))
    if wanted <= 1:
        return whole  # one chunk, also for a packed row of many short sequences (no grid of empty chunks)
    mean = max(1, _cdiv(_cdiv(seq_len, max(num_seqs, 1)), block_t)) if packed else whole
    return _cdiv(mean, min(mean, wanted))


class _Plan(NamedTuple):
    """Launch plan of the prefill kernels: grid ``(N * Hk, frequency blocks, chunks)``, ``chunk`` tokens each."""
    cfg: dict
    grid: tuple[int, int, int]
    chunk: int


def _plan(q: torch.Tensor, num_seqs: int, num_key_heads: int, rotary_pairs: int) -> _Plan:
    seq_len, head_dim = q.shape[1], q.shape[3]
    cfg = _config(rotary_pairs, head_dim - 2 * rotary_pairs)
    blocks_r = _cdiv(rotary_pairs, cfg["BLOCK_R"])
    packed = num_seqs != q.shape[0]  # (a packed row of one sequence is planned like a row)
    chunk = cfg["BLOCK_T"] * _chunk_tiles(seq_len, num_seqs, packed, num_seqs * num_key_heads * blocks_r,
                                          cfg["BLOCK_T"], q.device)
    return _Plan(cfg, (num_seqs * num_key_heads, blocks_r, _cdiv(seq_len, chunk)), chunk)


def _chunk_carries(plan: _Plan, increment: torch.Tensor, init: torch.Tensor | None,
                   cu_seqlens: torch.Tensor | None) -> torch.Tensor | None:
    """What pass 2 sums for the phase before every chunk (``_carry``): ``(N * Hk, chunks + 1, R)`` float64, the
    initial phase in slot 0 and chunk ``c``'s total in slot ``c + 1`` (pass 1 of the scan); for one chunk, the initial
    phase alone ``(N * Hk, 1, R)``, or ``None`` without one (zeros)."""
    rows, _, chunks = plan.grid
    rotary_pairs = increment.shape[3]
    if chunks == 1:
        return None if init is None else init.reshape(rows, 1, rotary_pairs)
    sums = increment.new_empty(rows, chunks + 1, rotary_pairs, dtype=torch.float64)
    _chunk_totals_kernel[plan.grid](
        increment, init if init is not None else sums, cu_seqlens if cu_seqlens is not None else sums, sums,
        increment.shape[1], increment.shape[2], rotary_pairs, chunks, plan.chunk, *increment.stride(),
        HAS_INIT=init is not None, IS_VARLEN=cu_seqlens is not None, BLOCK_T=plan.cfg["BLOCK_T"],
        BLOCK_R=plan.cfg["BLOCK_R"], num_warps=plan.cfg["num_warps"],
    )
    return sums


def _rotary_forward_impl(
    q: torch.Tensor,
    k: torch.Tensor,
    increment: torch.Tensor,
    temperature: torch.Tensor,
    initial_phase: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``increment`` ``(B, T, Hk, R)`` float32 (may be an expanded view), ``temperature`` ``(R,)`` float32,
    ``initial_phase`` ``(N, Hk, R)`` (float64; a float32 one is widened) -> rotated q, k and the final phase
    ``(N, Hk, R)`` float64."""
    batch, seq_len, num_query_heads, head_dim = q.shape
    num_key_heads, rotary_pairs = k.shape[2], temperature.shape[0]
    num_seqs = _num_seqs(q, cu_seqlens)
    # The kernels carry the phase in float64: a float32 initial phase (the op called directly) is widened here.
    init = None if initial_phase is None else _as(initial_phase, torch.float64).contiguous()
    out_q, out_k = torch.empty_like(q), torch.empty_like(k)
    final = torch.empty(num_seqs, num_key_heads, rotary_pairs, dtype=torch.float64, device=q.device)
    if seq_len == 0 or num_seqs == 0 or rotary_pairs == 0:
        out_q.copy_(q)
        out_k.copy_(k)
        final.copy_(init if init is not None else torch.zeros_like(final))
        return out_q, out_k, final
    plan = _plan(q, num_seqs, num_key_heads, rotary_pairs)
    _forward_walk(plan, _chunk_carries(plan, increment, init, cu_seqlens), q, k, increment, temperature, cu_seqlens,
                  out_q, out_k, final)
    return out_q, out_k, final


def _forward_walk(plan: _Plan, carries: torch.Tensor | None, q, k, increment, temperature, cu_seqlens, out_q, out_k,
                  final) -> None:
    """Pass 2 of the scan (``_selective_rotary_fwd_kernel``) from the carries it sums (``_chunk_carries``'s): the
    rotated q and k into ``out_q`` and ``out_k``, the final phase into ``final``."""
    seq_len, num_query_heads, head_dim = q.shape[1:]
    num_key_heads, rotary_pairs = k.shape[2], temperature.shape[0]
    _selective_rotary_fwd_kernel[plan.grid](
        q, k, increment, temperature.contiguous(), carries if carries is not None else final,
        out_q, out_k, final, cu_seqlens if cu_seqlens is not None else final,
        seq_len, num_key_heads, num_query_heads // num_key_heads, rotary_pairs, head_dim, plan.grid[2],
        carries.shape[1] if carries is not None else 0, plan.chunk,
        *q.stride(), *k.stride(), *out_q.stride(), *out_k.stride(), *increment.stride(),
        HAS_CARRY=carries is not None, IS_VARLEN=cu_seqlens is not None, HAS_PASS=head_dim > 2 * rotary_pairs,
        BLOCK_T=plan.cfg["BLOCK_T"], BLOCK_R=plan.cfg["BLOCK_R"], BLOCK_P=plan.cfg["BLOCK_P"],
        NUM_STAGES=plan.cfg["NUM_STAGES"], num_warps=plan.cfg["num_warps"],
    )


# The custom op wraps the plain function, which eager inference calls directly (``selective_rotary_triton``): the
# dispatcher's custom-op layers (autograd, no-grad, dynamo-disable wrappers) cost ~10 us of host time a call.
_rotary_forward = torch.library.custom_op("selective_rope::rotary_forward", _rotary_forward_impl, mutates_args=())


@_rotary_forward.register_fake
def _(q, k, increment, temperature, initial_phase, cu_seqlens):
    final = q.new_empty(_num_seqs(q, cu_seqlens), k.shape[2], temperature.shape[0], dtype=torch.float64)
    return torch.empty_like(q), torch.empty_like(k), final


def _rotary_backward_impl(
    q: torch.Tensor,
    k: torch.Tensor,
    grad_q: torch.Tensor,
    grad_k: torch.Tensor,
    grad_final: torch.Tensor | None,
    increment: torch.Tensor,
    temperature: torch.Tensor,
    initial_phase: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    need_temperature_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of ``rotary_forward``: ``(dq, dk, d_increment (B, T, Hk, R), d_temperature (R,),
    d_initial_phase (N, Hk, R))``: dq/dk in q's and k's dtypes, d_initial_phase float64, the others float32."""
    batch, seq_len, num_query_heads, head_dim = q.shape
    num_key_heads, rotary_pairs = k.shape[2], temperature.shape[0]
    num_seqs = _num_seqs(q, cu_seqlens)
    init = None if initial_phase is None else _as(initial_phase, torch.float64).contiguous()
    dinc = torch.zeros(batch, seq_len, num_key_heads, rotary_pairs, dtype=torch.float32, device=q.device)
    dfinal = None if grad_final is None else _as(grad_final, torch.float32).reshape(-1, rotary_pairs)
    if seq_len == 0 or num_seqs == 0 or rotary_pairs == 0:
        dq, dk = grad_q.clone(), grad_k.clone()
        dinit = torch.zeros(num_seqs, num_key_heads, rotary_pairs, dtype=torch.float64, device=q.device)
        if dfinal is not None:
            dinit += dfinal.view_as(dinit)
        return dq, dk, dinc, q.new_zeros(rotary_pairs, dtype=torch.float32), dinit
    plan = _plan(q, num_seqs, num_key_heads, rotary_pairs)
    carries = _chunk_carries(plan, increment, init, cu_seqlens)
    dq, dk, walk_sums, dinit = _backward_walks(plan, carries, q, k, grad_q, grad_k, dfinal, increment, temperature,
                                               cu_seqlens, need_temperature_grad, dinc)
    return dq, dk, dinc, walk_sums[:, plan.grid[2] + 1:].sum(dim=(0, 1)), dinit


def _backward_walks(plan: _Plan, carries: torch.Tensor | None, q, k, grad_q, grad_k, dfinal, increment, temperature,
                    cu_seqlens, need_temperature_grad: bool, dinc: torch.Tensor, fused: bool = False):
    """The backward's walks over every chunk (``_selective_rotary_bwd_kernel``, then with several chunks a sequence
    ``_suffix_sum_kernel``) from the carries pass 2 sums (``_chunk_carries``'s): ``(dq, dk, walk sums,
    d_initial_phase)``, ``d_increment`` written into ``dinc``. The walk sums ``(N * Hk, 2 chunks + 1, R)`` float32:
    slot 0 d final phase, slot ``chunks - c`` chunk c's Σ dθ (their sum over slots 0 .. chunks - 1 - c is what
    reaches chunk c from later in time, over every slot the gradient of the initial phase), slot ``chunks + 1 + c``
    chunk c's share of d(temperature) (summed in PyTorch by the rotary op, by ``phase_triton._temperature_gradient``
    in the fused op).

    ``fused`` (the fused op from the input, whose phase backward reads ``dinc``): one launch also with several chunks;
    each chunk is walked back alone, and ``phase_triton``'s backward adds the later chunks' sums to every token it
    reads, writes d(initial phase) (its buffer returned here unwritten) and sums d(temperature)."""
    seq_len, num_query_heads, head_dim = q.shape[1:]
    num_key_heads, rotary_pairs = k.shape[2], temperature.shape[0]
    rows, _, chunks = plan.grid
    dq, dk = torch.empty_like(q), torch.empty_like(k)
    # (one buffer for both kinds of sums: one allocation less)
    walk_sums = torch.empty(rows, 2 * chunks + 1, rotary_pairs, dtype=torch.float32, device=q.device)
    dinit = torch.empty(rows // num_key_heads, num_key_heads, rotary_pairs, dtype=torch.float64, device=q.device)
    placeholder = walk_sums  # for pointers a disabled branch never reads
    cu = cu_seqlens if cu_seqlens is not None else placeholder
    _selective_rotary_bwd_kernel[plan.grid](
        q, k, grad_q, grad_k, increment, temperature.contiguous(),
        carries if carries is not None else placeholder, dfinal if dfinal is not None else placeholder, cu,
        dq, dk, dinc, walk_sums, dinit,
        seq_len, num_key_heads, num_query_heads // num_key_heads, rotary_pairs, head_dim, chunks,
        carries.shape[1] if carries is not None else 0, plan.chunk,
        *q.stride(), *k.stride(), *grad_q.stride(), *grad_k.stride(), *dq.stride(), *dk.stride(),
        *increment.stride(), *dinc.stride()[:3],
        HAS_CARRY=carries is not None, HAS_DFINAL=dfinal is not None, NEED_DTEMP=need_temperature_grad,
        IS_VARLEN=cu_seqlens is not None, HAS_PASS=head_dim > 2 * rotary_pairs, WALK_BACK=fused,
        BLOCK_T=plan.cfg["BLOCK_T"], BLOCK_R=plan.cfg["BLOCK_R"], BLOCK_P=plan.cfg["BLOCK_P"],
        NUM_STAGES=plan.cfg["NUM_STAGES"], num_warps=plan.cfg["num_warps"],
    )
    if chunks > 1 and not fused:  # (with one chunk the kernel walked it back and wrote d initial phase)
        _suffix_sum_kernel[plan.grid](
            dinc, walk_sums, cu, dinit, seq_len, num_key_heads, rotary_pairs, chunks, plan.chunk,
            *dinc.stride()[:3], IS_VARLEN=cu_seqlens is not None,
            BLOCK_T=plan.cfg["BLOCK_T"], BLOCK_R=plan.cfg["BLOCK_R"], num_warps=plan.cfg["num_warps"],
        )
    return dq, dk, walk_sums, dinit


_rotary_backward = torch.library.custom_op("selective_rope::rotary_backward", _rotary_backward_impl,
                                          mutates_args=())


@_rotary_backward.register_fake
def _(q, k, grad_q, grad_k, grad_final, increment, temperature, initial_phase, cu_seqlens, need_temperature_grad):
    batch, seq_len, num_key_heads = k.shape[:3]
    rotary_pairs = temperature.shape[0]
    dinit = q.new_empty(_num_seqs(q, cu_seqlens), num_key_heads, rotary_pairs, dtype=torch.float64)
    dinc = q.new_empty(batch, seq_len, num_key_heads, rotary_pairs, dtype=torch.float32)
    return torch.empty_like(q), torch.empty_like(k), dinc, q.new_empty(rotary_pairs, dtype=torch.float32), dinit


def _setup_context(ctx, inputs, output) -> None:
    q, k, increment, temperature, initial_phase, cu_seqlens = inputs
    ctx.save_for_backward(q, k, increment, temperature, initial_phase, cu_seqlens)


def _backward(ctx, grad_q, grad_k, grad_final, backward=_rotary_backward):
    q, k, increment, temperature, initial_phase, cu_seqlens = ctx.saved_tensors
    grad_q = torch.zeros_like(q) if grad_q is None else grad_q
    grad_k = torch.zeros_like(k) if grad_k is None else grad_k
    dq, dk, dinc, dtemp, dinit = backward(q, k, grad_q, grad_k, grad_final, increment, temperature, initial_phase,
                                          cu_seqlens, ctx.needs_input_grad[3])
    return (dq, dk, dinc, dtemp if ctx.needs_input_grad[3] else None,
            dinit if initial_phase is not None else None, None)


_rotary_forward.register_autograd(_backward, setup_context=_setup_context)


class _EagerRotary(torch.autograd.Function):
    """``rotary_forward`` and its autograd for plain eager calls (``_plain_eager_call``): the custom ops' own
    functions, without their dispatch layers, and in the classic ``forward(ctx, ...)`` form, whose ``apply`` skips
    the ``inspect.signature`` binding that ``setup_context`` functions pay on every call. Host time of forward +
    backward, CPU, launches stubbed, B=1, T=256, interleaved: 88 against 142 us through the custom op (on run 4's
    H200 machine the op's autograd path cost ~500 us per call). Traced, compiled or subclassed calls and functorch
    transforms use the custom op (``_rotary_forward``), which they must see as one call."""

    @staticmethod
    def forward(ctx, q, k, increment, temperature, initial_phase, cu_seqlens):
        outputs = _rotary_forward_impl(q, k, increment, temperature, initial_phase, cu_seqlens)
        _setup_context(ctx, (q, k, increment, temperature, initial_phase, cu_seqlens), outputs)
        return outputs

    @staticmethod
    def backward(ctx, grad_q, grad_k, grad_final):
        # A backward that builds a graph (create_graph=True) calls the custom op, as the op's own autograd does: it
        # has no derivative, and the dispatcher says so, where the plain function would return constants.
        backward = _rotary_backward if torch.is_grad_enabled() else _rotary_backward_impl
        return _backward(ctx, grad_q, grad_k, grad_final, backward=backward)


def _plain_eager_call(inputs: tuple) -> bool:
    """Whether a call may run the op's function itself instead of the custom op: eager (not traced by
    ``torch.compile`` or ``torch.jit.trace``), with no dispatch mode active (``FakeTensorMode``, ``FlopCounterMode``,
    ...) and plain tensors or parameters (no fake tensors, ``DTensor``, FX proxies or other subclasses), which the
    dispatcher or the tracer must see as one call; not under functorch transforms (``torch.func``), which need the
    custom op's registrations."""
    if (torch.compiler.is_compiling() or torch.jit.is_tracing() or _get_current_dispatch_mode() is not None
            or torch._C._are_functorch_transforms_active()):
        return False
    for x in inputs:  # (a plain loop: all() over a generator costs more than the checks, per layer and decoding step)
        if x is not None and not isinstance(x, bool) and type(x) not in _PLAIN_TENSOR_TYPES:
            return False
    return True


def _check_shapes(q: torch.Tensor, k: torch.Tensor, temperature: torch.Tensor, cu_seqlens: torch.Tensor | None):
    num_query_heads, head_dim = q.shape[2:]
    num_key_heads, rotary_pairs = k.shape[2], temperature.shape[-1]
    if num_query_heads % num_key_heads:
        raise ValueError(f"Hq ({num_query_heads}) must be a multiple of Hk ({num_key_heads})")
    if 2 * rotary_pairs > head_dim:
        raise ValueError(f"2R ({2 * rotary_pairs}) exceeds the head size ({head_dim})")
    if k.shape[:2] != q.shape[:2] or k.shape[3] != head_dim:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree")
    if cu_seqlens is not None and q.shape[0] != 1:
        raise ValueError(f"cu_seqlens needs batch 1 (packed sequences), got batch {q.shape[0]}")


def selective_rotary_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    increment: torch.Tensor,
    temperature: torch.Tensor,
    initial_phase: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused Selective RoPE: accumulate the phase and rotate q and k (Triton; see ``rotary_torch.selective_rotary``).

    Args:
        q: ``(B, T, Hq, D)``; k: ``(B, T, Hk, D)`` with ``Hq % Hk == 0``.
        increment: phase increments broadcastable to ``(B, T, Hk, R)`` (e.g. ``(B, T, 1, 1)`` for RoPE).
        temperature: ``(R,)``, ``2R <= D`` (dims ``>= 2R`` pass through).
        initial_phase: ``(B, Hk, R)`` (``(N, Hk, R)`` with ``cu_seqlens``) cached phase (float64), or ``None``.
        cu_seqlens: optional ``(N + 1,)`` integer offsets of packed sequences (``B == 1``); the phase restarts
            at each boundary. As in flash-linear-attention, ``cu_seqlens[0] == 0`` and ``cu_seqlens[-1] == T``.

    Returns:
        Rotated ``q`` and ``k`` (input dtypes) and the final phase ``(B, Hk, R)`` (``(N, Hk, R)``) float64.
        Differentiable in q, k, increment, temperature and initial_phase.
    """
    _check_shapes(q, k, temperature, cu_seqlens)
    batch, seq_len, num_key_heads = k.shape[:3]
    rotary_pairs = temperature.shape[-1]
    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens.to(device=q.device, dtype=torch.int32).contiguous()
    # Broadcasts and casts happen here, outside the op, so that autograd reduces their gradients back to the shapes
    # and dtypes the caller passed (e.g. a (B, T, 1, 1) RoPE increment).
    # (``_as``: a cast to the dtype a tensor has is still a dispatched op, on the GPU host 10-25 us each)
    increment = _as(increment, torch.float32).expand(batch, seq_len, num_key_heads, rotary_pairs)
    if initial_phase is not None:
        initial_phase = _as(initial_phase, torch.float64).expand(_num_seqs(q, cu_seqlens), num_key_heads,
                                                                 rotary_pairs)
    temperature = _as(temperature, torch.float32)
    inputs = (q, k, increment, temperature, initial_phase, cu_seqlens)
    if not _plain_eager_call(inputs):
        return _rotary_forward(*inputs)
    if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in inputs):
        return _EagerRotary.apply(*inputs)
    return _rotary_forward_impl(*inputs)  # nothing to differentiate


# --------------------------------------------------------------------------------------------------------------------
# custom op: the fused decode step
# --------------------------------------------------------------------------------------------------------------------
def _rotary_decode_impl(
    q: torch.Tensor,
    k: torch.Tensor,
    projection: torch.Tensor,
    temperature: torch.Tensor,
    phase: torch.Tensor,
    conv_state: torch.Tensor | None,
    conv_weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    gate_logits: torch.Tensor | None,
    valid: torch.Tensor | None,
    silu: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Shapes as in ``selective_rotary_decode_triton``: ``projection``, ``phase``, ``conv_state`` and ``gate_logits``
    float64, ``temperature``, ``conv_weight`` and ``bias`` float32; ``phase`` and ``conv_state`` are given (zeros at a
    sequence start). Returns q, k, the new phase and the new history (``(B, 0, C)`` without conv), float64."""
    return _decode_from_projection(q, k, projection, temperature, phase, conv_state, conv_weight, bias, gate_logits,
                                   valid, silu, in_place=False)


def _decode_from_projection(q, k, projection, temperature, phase, conv_state, conv_weight, bias, gate_logits, valid,
                            silu: bool, in_place: bool):
    """``_launch_decode`` of the decode kernel that takes the phase inputs (both custom ops' function)."""
    batch, num_key_heads, rotary_pairs = k.shape[0], k.shape[-2], temperature.shape[0]
    gate = projection if gate_logits is None else gate_logits.expand(batch, num_key_heads, rotary_pairs)
    return _launch_decode(_selective_rotary_decode_kernel, (projection, gate), (*projection.stride(), *gate.stride()),
                          {}, q, k, temperature, phase, conv_state, conv_weight, bias, valid, silu,
                          has_gate=gate_logits is not None, in_place=in_place)


@functools.lru_cache(maxsize=None)
def _decode_blocks(rotary_pairs: int, head_dim: int) -> dict[str, int]:
    """The decode kernels' blocks and warps: one program holds all R pairs of its head, so there is no tile to spread
    over more than 4 warps. (Cached: computed per layer and step otherwise.)"""
    pass_block = _config(rotary_pairs, head_dim - 2 * rotary_pairs)["BLOCK_P"]
    return {"BLOCK_R": _next_power_of_2(rotary_pairs), "BLOCK_P": pass_block, "num_warps": 4}


def _launch_decode(kernel, inputs: tuple, input_args: tuple, input_meta: dict, q, k, temperature, phase, conv_state,
                   conv_weight, bias, valid, silu: bool, has_gate: bool, in_place: bool = False):
    """Allocate a decoding step's outputs and launch ``kernel`` (one of the two decode kernels, which share their
    arguments but for the phase ``inputs``, given after q and k, and ``input_args`` and ``input_meta``, given last)
    with one program per (row, key head). Returns q, k, the new phase and the new history, as
    ``_rotary_decode_impl``. ``in_place``: the new phase and history are written into ``phase`` and ``conv_state``
    (contiguous, float64), which are returned: each program reads its own (row, head) slots before it writes them,
    and history slot j before it writes slot j - 1. q and k are ``(B, H, D)`` or the layer's ``(B, 1, H, D)`` (no
    view to make: on the GPU host each torch op costs 10-25 us per layer and step); the outputs have their shapes."""
    batch, num_query_heads, head_dim = q.shape[0], q.shape[-2], q.shape[-1]
    num_key_heads, rotary_pairs = k.shape[-2], temperature.shape[0]
    out_q, out_k = torch.empty_like(q), torch.empty_like(k)
    conv_k = 0 if conv_weight is None else conv_weight.shape[-1]
    if in_place:
        new_phase = phase
        new_conv = conv_state if conv_k else q.new_empty(batch, 0, num_key_heads * rotary_pairs, dtype=torch.float64)
    else:
        new_phase = torch.empty(batch, num_key_heads, rotary_pairs, dtype=torch.float64, device=q.device)
        new_conv = q.new_empty(batch, max(conv_k - 1, 0), num_key_heads * rotary_pairs, dtype=torch.float64)
    if batch == 0 or rotary_pairs == 0:
        out_q.copy_(q)
        out_k.copy_(k)
        if not in_place:
            new_phase.copy_(phase)
            if conv_state is not None:
                new_conv.copy_(conv_state)
        return out_q, out_k, new_phase, new_conv
    placeholder = new_phase  # for pointers a disabled branch never reads
    kernel[(batch * num_key_heads,)](
        q, k, *inputs, temperature.contiguous(), phase.contiguous(),
        conv_state.contiguous() if conv_state is not None else placeholder,
        conv_weight.contiguous() if conv_weight is not None else placeholder,
        bias.contiguous() if bias is not None else placeholder,
        valid if valid is not None else placeholder,
        out_q, out_k, new_phase, new_conv,
        num_key_heads, num_query_heads // num_key_heads, rotary_pairs, head_dim,
        *_row_head_dim_strides(q), *_row_head_dim_strides(k), *_row_head_dim_strides(out_q),
        *_row_head_dim_strides(out_k), *input_args,
        CONV_K=conv_k, SILU=silu, HAS_BIAS=bias is not None, HAS_GATE=has_gate,
        HAS_VALID=valid is not None, HAS_PASS=head_dim > 2 * rotary_pairs,
        **_decode_blocks(rotary_pairs, head_dim), **input_meta,
    )
    return out_q, out_k, new_phase, new_conv


_rotary_decode = torch.library.custom_op("selective_rope::rotary_decode", _rotary_decode_impl, mutates_args=())


@_rotary_decode.register_fake
def _(q, k, projection, temperature, phase, conv_state, conv_weight, bias, gate_logits, valid, silu):
    batch, num_key_heads, rotary_pairs = k.shape[0], k.shape[-2], temperature.shape[0]
    conv_k = 0 if conv_weight is None else conv_weight.shape[-1]
    new_conv = q.new_empty(batch, max(conv_k - 1, 0), num_key_heads * rotary_pairs, dtype=torch.float64)
    new_phase = q.new_empty(batch, num_key_heads, rotary_pairs, dtype=torch.float64)
    return torch.empty_like(q), torch.empty_like(k), new_phase, new_conv


def _rotary_decode_in_place_impl(
    q: torch.Tensor,
    k: torch.Tensor,
    projection: torch.Tensor,
    temperature: torch.Tensor,
    phase: torch.Tensor,
    conv_state: torch.Tensor | None,
    conv_weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    gate_logits: torch.Tensor | None,
    valid: torch.Tensor | None,
    silu: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``_rotary_decode_impl`` writing the new phase and history into ``phase`` and ``conv_state`` (a static cache's:
    contiguous float64) rather than new tensors. Returns q and k (an op's outputs may not alias its inputs)."""
    q_out, k_out, _, _ = _decode_from_projection(q, k, projection, temperature, phase, conv_state, conv_weight, bias,
                                                 gate_logits, valid, silu, in_place=True)
    return q_out, k_out


# The mutation is declared, so functionalization (torch.compile, export) sees the writes to the cache's tensors.
_rotary_decode_in_place = torch.library.custom_op("selective_rope::rotary_decode_in_place",
                                                  _rotary_decode_in_place_impl, mutates_args=("phase", "conv_state"))


@_rotary_decode_in_place.register_fake
def _(q, k, projection, temperature, phase, conv_state, conv_weight, bias, gate_logits, valid, silu):
    return torch.empty_like(q), torch.empty_like(k)


def _row_head_dim_strides(x: torch.Tensor) -> tuple[int, int, int]:
    """The strides of a decoding step's ``(B, H, D)`` or ``(B, 1, H, D)`` tensor along rows, heads and dims."""
    return x.stride(0), x.stride(-2), x.stride(-1)


def _writable(state: torch.Tensor | None) -> bool:
    """Whether a step can write its new state into ``state`` (``in_place``): one dense float64 tensor."""
    return state is not None and state.dtype == torch.float64 and state.is_contiguous()


def _in_place(in_place: bool, phase: torch.Tensor | None, conv_state: torch.Tensor | None,
              conv_weight: torch.Tensor | None) -> bool:
    """Whether a step asked to write in place can: there is a phase (and a history, with a convolution) to write."""
    return in_place and _writable(phase) and (conv_weight is None or _writable(conv_state))


def _check_phase_weights(x, down, up, gate_weight) -> None:
    num_key_heads, rank, chunk_dim = down.shape
    hidden = x.shape[-1]
    if (up.shape != (num_key_heads, up.shape[1], rank) or hidden != num_key_heads * chunk_dim
            or (gate_weight is not None and gate_weight.shape != (num_key_heads, hidden))):
        raise ValueError(f"x {tuple(x.shape)}, down {tuple(down.shape)}, up {tuple(up.shape)} and gate weight "
                         f"{None if gate_weight is None else tuple(gate_weight.shape)} disagree")


@functools.lru_cache(maxsize=None)
def _phase_blocks(chunk_dim: int, rank: int) -> dict[str, int]:
    """Input chunks are read in blocks of up to 64 values: a (rank, 64) float64 tile at most. (Cached, as
    ``_decode_blocks``.)"""
    return {"BLOCK_D": min(_next_power_of_2(chunk_dim), 64), "BLOCK_RANK": _next_power_of_2(rank)}


def selective_rotary_decode_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    projection: torch.Tensor,
    temperature: torch.Tensor,
    phase: torch.Tensor | None = None,
    conv_state: torch.Tensor | None = None,
    conv_weight: torch.Tensor | None = None,
    conv_activation: str | None = None,
    bias: torch.Tensor | None = None,
    gate_logits: torch.Tensor | None = None,
    valid: torch.Tensor | None = None,
    in_place: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One decoding step of Selective RoPE for every row, fused (SPEC §3 steps 3-8, in training order).

    Args:
        q: ``(B, Hq, D)``; k: ``(B, Hk, D)``: this step's query and key, ``Hq % Hk == 0``; or both as the layer has
            them, ``(B, 1, Hq, D)`` and ``(B, 1, Hk, D)`` (then so are the results).
        projection: ``(B, Hk, R)`` the phase projection ``P(u)`` of this step's input, float64 (any strides, e.g.
            the expanded output of the ``scalar`` projection).
        temperature: ``(R,)``.
        phase: ``(B, Hk, R)`` the cached phase, float64 (``None``: a sequence start, zeros).
        conv_state: ``(B, K-1, Hk*R)`` the convolution's history, oldest first, float64 (``None``: zeros).
        conv_weight: ``(Hk*R, K)`` the taps (the last multiplies this step), or ``None`` for no convolution; or a
            depthwise ``nn.Conv1d``'s ``(Hk*R, 1, K)`` weight as it is.
        conv_activation: ``None`` or ``"silu"``, after the convolution.
        bias: ``(Hk, R)`` the raw bias ``b`` (``exp(b)`` is added), or ``None``.
        gate_logits: ``G(u)`` before the sigmoid, ``(B, Hk, 1)`` (one per head) or ``(B, Hk, R)``, float64, or
            ``None``.
        valid: ``(B,)`` bool, False where this step's token is padding (adds 0, history unchanged), or ``None``.
        in_place: write the new phase and history into ``phase`` and ``conv_state`` themselves (a static cache's,
            whose addresses must not change) and return them, where they are contiguous float64 tensors (else new
            ones, as without it); traced, a custom op that declares the mutation.

    Returns:
        Rotated ``q`` and ``k`` (input dtypes), the new phase ``(B, Hk, R)`` and the new convolution history
        ``(B, K-1, Hk*R)`` (``None`` without convolution), both float64. Not differentiable: for inference.
    """
    step = _step_inputs(q, k, temperature, phase, conv_state, conv_weight, conv_activation, bias, valid)
    projection = _as(projection, torch.float64).expand(k.shape[0], k.shape[-2], temperature.shape[-1])
    gate_logits = None if gate_logits is None else _as(gate_logits, torch.float64)
    inputs = (q, k, projection, step.temperature, step.phase, step.conv_state, step.conv_weight, step.bias,
              gate_logits, step.valid, step.silu)
    # The custom op's dispatch layers cost ~10 us, a good part of a decoding step's budget: plain eager calls skip them.
    plain = _plain_eager_call(inputs)
    if _in_place(in_place, phase, conv_state, conv_weight):
        q_out, k_out = (_rotary_decode_in_place_impl if plain else _rotary_decode_in_place)(*inputs)
        return q_out, k_out, phase, conv_state if conv_weight is not None else None
    q_out, k_out, new_phase, new_conv = (_rotary_decode_impl if plain else _rotary_decode)(*inputs)
    return q_out, k_out, new_phase, (new_conv if conv_weight is not None else None)


def selective_rotary_decode_from_input_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    x: torch.Tensor,
    down: torch.Tensor,
    up: torch.Tensor,
    gate_weight: torch.Tensor | None,
    gate_bias: torch.Tensor | None,
    temperature: torch.Tensor,
    phase: torch.Tensor | None = None,
    conv_state: torch.Tensor | None = None,
    conv_weight: torch.Tensor | None = None,
    conv_activation: str | None = None,
    bias: torch.Tensor | None = None,
    valid: torch.Tensor | None = None,
    in_place: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """``selective_rotary_decode_triton`` for the default phase path (a ``"low_rank"`` projection, a per-head gate
    or none), with steps 1-2 in the same launch: from this step's input ``x`` and the phase modules' weights, what
    ``PhaseProjection(u)`` and ``PhaseLinear(u)`` compute in float64 from the L2-normalised input chunks ``u`` (the
    same results, summed in another order: equal within float64 rounding, which the increment's rounding to float32
    absorbs). On a GPU each launch and each small torch op cost host time (run 4's H200 machine: 47-87 us per Triton
    launch, ~10-25 per torch op) in every layer of every decoding step, which is host-bound: this is one launch.

    Args:
        x: ``(B, Hk * Dc)`` or ``(B, 1, Hk * Dc)`` this step's input (any float dtype; rows may be strided).
        down: ``(Hk, rank, Dc)``; up: ``(Hk, R, rank)``: the projection's weights (any float dtype).
        gate_weight: ``(Hk, Hk * Dc)``; gate_bias: ``(Hk,)``: the per-head gate, or ``None`` for no gate.
        The rest: as ``selective_rotary_decode_triton``'s.

    Returns:
        As ``selective_rotary_decode_triton``; or ``None`` where the call is not plain eager (traced, under a dispatch
        mode, tensor subclasses: this launch has no custom op, so the caller runs the two functions there).
    """
    if not _plain_eager_call((q, k, x, down, up, gate_weight, gate_bias, temperature, phase, conv_state, conv_weight,
                              bias, valid)):
        return None
    _check_phase_weights(x, down, up, gate_weight)
    if x.shape[:-1] != q.shape[:-2]:
        raise ValueError(f"x {tuple(x.shape)} and q {tuple(q.shape)} disagree: one input row per query row")
    step = _step_inputs(q, k, temperature, phase, conv_state, conv_weight, conv_activation, bias, valid)
    x = x if x.stride(-1) == 1 else x.contiguous()
    chunk_dim, rank = down.shape[2], down.shape[1]
    gate = (x, x) if gate_weight is None else (gate_weight.contiguous(), gate_bias.contiguous())  # x: unread
    meta = _phase_blocks(chunk_dim, rank)
    q_out, k_out, new_phase, new_conv = _launch_decode(
        _selective_rotary_decode_from_input_kernel, (x, down.contiguous(), up.contiguous(), *gate),
        (chunk_dim, rank, x.stride(0)), meta, q, k, step.temperature, step.phase, step.conv_state, step.conv_weight,
        step.bias, step.valid, step.silu, has_gate=gate_weight is not None,
        in_place=_in_place(in_place, phase, conv_state, conv_weight))
    return q_out, k_out, new_phase, (new_conv if conv_weight is not None else None)


class _StepInputs(NamedTuple):
    """A decoding step's state and parameters in the dtypes the decode kernels read."""

    temperature: torch.Tensor
    phase: torch.Tensor
    conv_state: torch.Tensor | None
    conv_weight: torch.Tensor | None
    bias: torch.Tensor | None
    valid: torch.Tensor | None
    silu: bool


def _step_inputs(q, k, temperature, phase, conv_state, conv_weight, conv_activation, bias, valid) -> _StepInputs:
    """Checks and casts shared by both decode entry points: zeros for a missing phase or history (a sequence start),
    float32 parameters, float64 state, ``valid`` as int32."""
    if conv_activation not in (None, "silu"):
        raise ValueError(f"unsupported activation {conv_activation!r}; expected None or 'silu'")
    batch, num_key_heads = k.shape[0], k.shape[-2]
    rotary_pairs = temperature.shape[-1]
    if (q.shape[-2] % num_key_heads or 2 * rotary_pairs > q.shape[-1] or q.shape[-1] != k.shape[-1]
            or q.dim() != k.dim() or q.dim() not in (3, 4) or (q.dim() == 4 and (q.shape[1], k.shape[1]) != (1, 1))):
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)} and R={rotary_pairs} disagree: expected "
                         "(B, Hq, D) and (B, Hk, D), or (B, 1, Hq, D) and (B, 1, Hk, D), with Hq % Hk == 0 and 2R <= D")
    if phase is None:
        phase = q.new_zeros(batch, num_key_heads, rotary_pairs, dtype=torch.float64)
    if conv_weight is not None and conv_state is None:
        conv_state = q.new_zeros(batch, conv_weight.shape[-1] - 1, num_key_heads * rotary_pairs, dtype=torch.float64)
    return _StepInputs(_as(temperature, torch.float32), _as(phase, torch.float64),
                       None if conv_weight is None else _as(conv_state, torch.float64),
                       None if conv_weight is None else _as(conv_weight, torch.float32),
                       None if bias is None else _as(bias, torch.float32),
                       None if valid is None else _as(valid, torch.int32),
                       conv_activation == "silu")


def _as(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor.to(dtype)``, without a dispatched call where it already is (~0.5 us each, per layer and step)."""
    return tensor if tensor.dtype == dtype else tensor.to(dtype)
