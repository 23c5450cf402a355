"""Selective RoPE's fused cumulative phase + rotation in Triton (forward and backward).

Same interface and semantics as :func:`selective_rope.kernels.rotary_torch.selective_rotary` (the reference), plus
packed sequences (``cu_seqlens``). One program per (sequence, key head, block of frequency pairs) walks over time in
tiles with a running float32 carry of the phase, so the cumulative sum never leaves the program:

    θ_t = θ_0 + Σ_{s<=t} c_s,   angle_t = τ · θ_t,   (x_i, x_{i+R}) -> (x_i cos − x_{i+R} sin, x_i sin + x_{i+R} cos)

for the key head and every query head of its group (GPT-NeoX halves; dims ``>= 2R`` pass through).

Backward, same grid: a forward walk recomputes the phase, writes ``dq``/``dk`` (the inverse rotation of the
incoming gradients) and the per-position ``dθ_t = τ · Σ_heads (dy_2 · y_1 − dy_1 · y_2)`` (summed over the query
heads of the group inside the program), then a reverse walk over the same tiles turns ``dθ`` into
``d(increment)_s = Σ_{t>=s} dθ_t (+ d final phase)``. ``d(initial_phase)`` is the total and ``d(temperature)`` is
reduced from per-program partials in PyTorch (no atomics).

Runs on CUDA, and on CPU under ``TRITON_INTERPRET=1`` (how the tests check it against the torch reference).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

__all__ = ["selective_rotary_triton"]


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def _config(rotary_pairs: int, pass_dims: int) -> dict[str, int]:
    """One fixed configuration (no autotuning): small tiles under the interpreter, wider ones on a GPU."""
    block_t = 16 if _interpreting() else 64
    block_r = max(1, min(triton.next_power_of_2(max(rotary_pairs, 1)), 64))
    block_p = max(1, min(triton.next_power_of_2(max(pass_dims, 1)), 64))
    return {"BLOCK_T": block_t, "BLOCK_R": block_r, "BLOCK_P": block_p, "num_warps": 4}


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
def _selective_rotary_fwd_kernel(
    q_ptr, k_ptr, inc_ptr, temp_ptr, init_ptr, oq_ptr, ok_ptr, final_ptr, cu_ptr,
    T, Hk, G, R, D,
    sq_b, sq_t, sq_h, sq_d,
    sk_b, sk_t, sk_h, sk_d,
    soq_b, soq_t, soq_h, soq_d,
    sok_b, sok_t, sok_h, sok_d,
    si_b, si_t, si_h, si_r,
    HAS_INIT: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_PASS: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
):
    pid_nh = tl.program_id(0)
    pid_r = tl.program_id(1)
    n = pid_nh // Hk
    hk = pid_nh % Hk
    b, bos, eos = _span(n, cu_ptr, T, IS_VARLEN)

    rs = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_r = rs < R
    temp = tl.load(temp_ptr + rs, mask=mask_r, other=0.0).to(tl.float32)
    state_offs = pid_nh.to(tl.int64) * R + rs  # (n, hk, r) in a contiguous (N, Hk, R) tensor
    if HAS_INIT:
        carry = tl.load(init_ptr + state_offs, mask=mask_r, other=0.0).to(tl.float32)
    else:
        carry = tl.full([BLOCK_R], 0.0, tl.float32)

    inc_base = inc_ptr + b * si_b + hk * si_h
    k_base = k_ptr + b * sk_b + hk * sk_h
    ok_base = ok_ptr + b * sok_b + hk * sok_h
    for t0 in range(bos, eos, BLOCK_T):
        ts = t0 + tl.arange(0, BLOCK_T)
        mask_t = ts < eos
        mask = mask_t[:, None] & mask_r[None, :]
        inc = tl.load(inc_base + ts[:, None] * si_t + rs[None, :] * si_r, mask=mask, other=0.0).to(tl.float32)
        phase = _cumsum(inc, False) + carry[None, :]
        carry += _sum0(inc)
        angle = phase * temp[None, :]
        cos = tl.cos(angle)
        sin = tl.sin(angle)

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

        if HAS_PASS:  # dims >= 2R are copied by the first frequency block only
            if pid_r == 0:
                for p0 in range(2 * R, D, BLOCK_P):
                    ds = p0 + tl.arange(0, BLOCK_P)
                    pmask = mask_t[:, None] & (ds < D)[None, :]
                    x = tl.load(k_base + ts[:, None] * sk_t + ds[None, :] * sk_d, mask=pmask, other=0.0)
                    tl.store(ok_base + ts[:, None] * sok_t + ds[None, :] * sok_d,
                             x.to(ok_ptr.dtype.element_ty), mask=pmask)
                    for g in range(G):
                        hq = hk * G + g
                        x = tl.load(q_ptr + b * sq_b + hq * sq_h + ts[:, None] * sq_t + ds[None, :] * sq_d,
                                    mask=pmask, other=0.0)
                        tl.store(oq_ptr + b * soq_b + hq * soq_h + ts[:, None] * soq_t + ds[None, :] * soq_d,
                                 x.to(oq_ptr.dtype.element_ty), mask=pmask)

    tl.store(final_ptr + state_offs, carry, mask=mask_r)


@triton.jit
def _selective_rotary_bwd_kernel(
    q_ptr, k_ptr, dyq_ptr, dyk_ptr, inc_ptr, temp_ptr, init_ptr, dfinal_ptr, cu_ptr,
    dq_ptr, dk_ptr, dinc_ptr, dtemp_ptr, dinit_ptr,
    T, Hk, G, R, D,
    sq_b, sq_t, sq_h, sq_d,
    sk_b, sk_t, sk_h, sk_d,
    sdyq_b, sdyq_t, sdyq_h, sdyq_d,
    sdyk_b, sdyk_t, sdyk_h, sdyk_d,
    sdq_b, sdq_t, sdq_h, sdq_d,
    sdk_b, sdk_t, sdk_h, sdk_d,
    si_b, si_t, si_h, si_r,
    sdi_b, sdi_t, sdi_h,
    HAS_INIT: tl.constexpr, HAS_DFINAL: tl.constexpr, NEED_DTEMP: tl.constexpr, NEED_DINIT: tl.constexpr,
    IS_VARLEN: tl.constexpr, HAS_PASS: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
):
    pid_nh = tl.program_id(0)
    pid_r = tl.program_id(1)
    n = pid_nh // Hk
    hk = pid_nh % Hk
    b, bos, eos = _span(n, cu_ptr, T, IS_VARLEN)

    rs = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_r = rs < R
    temp = tl.load(temp_ptr + rs, mask=mask_r, other=0.0).to(tl.float32)
    state_offs = pid_nh.to(tl.int64) * R + rs
    if HAS_INIT:
        carry = tl.load(init_ptr + state_offs, mask=mask_r, other=0.0).to(tl.float32)
    else:
        carry = tl.full([BLOCK_R], 0.0, tl.float32)
    dphase_total = tl.full([BLOCK_R], 0.0, tl.float32)
    dtemp_acc = tl.full([BLOCK_R], 0.0, tl.float32)

    inc_base = inc_ptr + b * si_b + hk * si_h
    dinc_base = dinc_ptr + b * sdi_b + hk * sdi_h
    # Walk 1 (forward in time): recompute the phase exactly as the forward did, rotate the gradients back,
    # and write dθ_t (summed over the key head and its query heads) into the d(increment) buffer.
    for t0 in range(bos, eos, BLOCK_T):
        ts = t0 + tl.arange(0, BLOCK_T)
        mask_t = ts < eos
        mask = mask_t[:, None] & mask_r[None, :]
        inc = tl.load(inc_base + ts[:, None] * si_t + rs[None, :] * si_r, mask=mask, other=0.0).to(tl.float32)
        phase = _cumsum(inc, False) + carry[None, :]
        carry += _sum0(inc)
        angle = phase * temp[None, :]
        cos = tl.cos(angle)
        sin = tl.sin(angle)

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
            dtemp_acc += _sum0(tl.where(mask, phase * dangle, 0.0))
        tl.store(dinc_base + ts[:, None] * sdi_t + rs[None, :], dphase, mask=mask)

        if HAS_PASS:  # pass-through dims: the gradient is copied by the first frequency block only
            if pid_r == 0:
                for p0 in range(2 * R, D, BLOCK_P):
                    ds = p0 + tl.arange(0, BLOCK_P)
                    pmask = mask_t[:, None] & (ds < D)[None, :]
                    dy = tl.load(dyk_ptr + b * sdyk_b + hk * sdyk_h + ts[:, None] * sdyk_t + ds[None, :] * sdyk_d,
                                 mask=pmask, other=0.0)
                    tl.store(dk_ptr + b * sdk_b + hk * sdk_h + ts[:, None] * sdk_t + ds[None, :] * sdk_d,
                             dy.to(dk_ptr.dtype.element_ty), mask=pmask)
                    for g in range(G):
                        hq = hk * G + g
                        dy = tl.load(dyq_ptr + b * sdyq_b + hq * sdyq_h + ts[:, None] * sdyq_t
                                     + ds[None, :] * sdyq_d, mask=pmask, other=0.0)
                        tl.store(dq_ptr + b * sdq_b + hq * sdq_h + ts[:, None] * sdq_t + ds[None, :] * sdq_d,
                                 dy.to(dq_ptr.dtype.element_ty), mask=pmask)

    # Walk 2 (reverse in time): d(increment)_s = Σ_{t>=s} dθ_t + d(final phase), in place over the dθ buffer.
    tl.debug_barrier()
    if HAS_DFINAL:
        suffix = tl.load(dfinal_ptr + state_offs, mask=mask_r, other=0.0).to(tl.float32)
    else:
        suffix = tl.full([BLOCK_R], 0.0, tl.float32)
    dphase_total += suffix
    num_tiles = (eos - bos + BLOCK_T - 1) // BLOCK_T
    for i in range(0, num_tiles):
        ts = bos + (num_tiles - 1 - i) * BLOCK_T + tl.arange(0, BLOCK_T)
        mask = (ts < eos)[:, None] & mask_r[None, :]
        ptrs = dinc_base + ts[:, None] * sdi_t + rs[None, :]
        dphase = tl.load(ptrs, mask=mask, other=0.0)
        tl.store(ptrs, _cumsum(dphase, True) + suffix[None, :], mask=mask)
        suffix += _sum0(dphase)

    if NEED_DINIT:
        tl.store(dinit_ptr + state_offs, dphase_total, mask=mask_r)
    if NEED_DTEMP:
        tl.store(dtemp_ptr + state_offs, dtemp_acc, mask=mask_r)


def _reduce_to(grad: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Sum a ``(B, T, Hk, R)`` gradient back to the (broadcastable) shape the increment was given in."""
    extra = grad.dim() - len(shape)
    if extra > 0:
        grad = grad.sum(dim=tuple(range(extra)))
    dims = tuple(i for i, size in enumerate(shape) if size == 1 and grad.shape[i] != 1)
    if dims:
        grad = grad.sum(dim=dims, keepdim=True)
    return grad.reshape(shape)


class SelectiveRotaryTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, increment, temperature, initial_phase, cu_seqlens):
        batch, seq_len, num_query_heads, head_dim = q.shape
        num_key_heads = k.shape[2]
        half = temperature.shape[-1]
        if num_query_heads % num_key_heads:
            raise ValueError(f"Hq ({num_query_heads}) must be a multiple of Hk ({num_key_heads})")
        if 2 * half > head_dim:
            raise ValueError(f"2R ({2 * half}) exceeds the head size ({head_dim})")
        if k.shape[:2] != q.shape[:2] or k.shape[3] != head_dim:
            raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree")
        num_seqs = batch
        if cu_seqlens is not None:
            if batch != 1:
                raise ValueError(f"cu_seqlens needs batch 1 (packed sequences), got batch {batch}")
            num_seqs = cu_seqlens.numel() - 1
        inc = increment.float().expand(batch, seq_len, num_key_heads, half)
        temp = temperature.float().contiguous()
        init = None if initial_phase is None else initial_phase.float().expand(num_seqs, num_key_heads, half)
        init = None if init is None else init.contiguous()

        out_q, out_k = torch.empty_like(q), torch.empty_like(k)
        final = torch.empty(num_seqs, num_key_heads, half, dtype=torch.float32, device=q.device)
        if seq_len == 0 or num_seqs == 0 or half == 0:
            out_q.copy_(q)
            out_k.copy_(k)
            final.copy_(init if init is not None else torch.zeros_like(final))
        else:
            cfg = _config(half, head_dim - 2 * half)
            grid = (num_seqs * num_key_heads, triton.cdiv(half, cfg["BLOCK_R"]))
            _selective_rotary_fwd_kernel[grid](
                q, k, inc, temp, init if init is not None else final, out_q, out_k, final,
                cu_seqlens if cu_seqlens is not None else final,
                seq_len, num_key_heads, num_query_heads // num_key_heads, half, head_dim,
                *q.stride(), *k.stride(), *out_q.stride(), *out_k.stride(), *inc.stride(),
                HAS_INIT=init is not None, IS_VARLEN=cu_seqlens is not None, HAS_PASS=head_dim > 2 * half,
                BLOCK_T=cfg["BLOCK_T"], BLOCK_R=cfg["BLOCK_R"], BLOCK_P=cfg["BLOCK_P"], num_warps=cfg["num_warps"],
            )
        ctx.save_for_backward(q, k, inc, temp, init, cu_seqlens)
        ctx.increment_shape, ctx.increment_dtype = increment.shape, increment.dtype
        ctx.temperature_dtype = temperature.dtype
        ctx.initial_shape = None if initial_phase is None else initial_phase.shape
        ctx.initial_dtype = None if initial_phase is None else initial_phase.dtype
        return out_q, out_k, final

    @staticmethod
    def backward(ctx, grad_q, grad_k, grad_final):
        q, k, inc, temp, init, cu_seqlens = ctx.saved_tensors
        batch, seq_len, num_query_heads, head_dim = q.shape
        num_key_heads, half = k.shape[2], temp.shape[0]
        num_seqs = batch if cu_seqlens is None else cu_seqlens.numel() - 1
        need_dtemp = ctx.needs_input_grad[3]
        need_dinit = ctx.needs_input_grad[4] and init is not None
        grad_q = torch.zeros_like(q) if grad_q is None else grad_q
        grad_k = torch.zeros_like(k) if grad_k is None else grad_k

        dq, dk = torch.empty_like(q), torch.empty_like(k)
        dinc = torch.zeros(batch, seq_len, num_key_heads, half, dtype=torch.float32, device=q.device)
        dinit = torch.zeros(num_seqs, num_key_heads, half, dtype=torch.float32, device=q.device)
        dtemp_partial = torch.zeros(num_seqs, num_key_heads, half, dtype=torch.float32, device=q.device)
        if seq_len == 0 or num_seqs == 0 or half == 0:
            dq.copy_(grad_q)
            dk.copy_(grad_k)
            if grad_final is not None:
                dinit += grad_final.float()
        else:
            cfg = _config(half, head_dim - 2 * half)
            grid = (num_seqs * num_key_heads, triton.cdiv(half, cfg["BLOCK_R"]))
            dfinal = None if grad_final is None else grad_final.float().contiguous()
            _selective_rotary_bwd_kernel[grid](
                q, k, grad_q, grad_k, inc, temp, init if init is not None else dinit,
                dfinal if dfinal is not None else dinit, cu_seqlens if cu_seqlens is not None else dinit,
                dq, dk, dinc, dtemp_partial, dinit,
                seq_len, num_key_heads, num_query_heads // num_key_heads, half, head_dim,
                *q.stride(), *k.stride(), *grad_q.stride(), *grad_k.stride(), *dq.stride(), *dk.stride(),
                *inc.stride(), *dinc.stride()[:3],
                HAS_INIT=init is not None, HAS_DFINAL=dfinal is not None, NEED_DTEMP=need_dtemp,
                NEED_DINIT=need_dinit, IS_VARLEN=cu_seqlens is not None, HAS_PASS=head_dim > 2 * half,
                BLOCK_T=cfg["BLOCK_T"], BLOCK_R=cfg["BLOCK_R"], BLOCK_P=cfg["BLOCK_P"], num_warps=cfg["num_warps"],
            )
        d_increment = None
        if ctx.needs_input_grad[2]:
            d_increment = _reduce_to(dinc, ctx.increment_shape).to(ctx.increment_dtype)
        d_temperature = dtemp_partial.sum(dim=(0, 1)).to(ctx.temperature_dtype) if need_dtemp else None
        d_initial = None
        if need_dinit:
            d_initial = _reduce_to(dinit, ctx.initial_shape).to(ctx.initial_dtype)
        return dq, dk, d_increment, d_temperature, d_initial, None


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
        initial_phase: ``(B, Hk, R)`` (``(N, Hk, R)`` with ``cu_seqlens``) cached phase, or ``None``.
        cu_seqlens: optional ``(N + 1,)`` integer offsets of packed sequences (``B == 1``); the phase restarts
            at each boundary. As in flash-linear-attention, ``cu_seqlens[0] == 0`` and ``cu_seqlens[-1] == T``.

    Returns:
        Rotated ``q`` and ``k`` (input dtypes) and the final phase ``(B, Hk, R)`` (``(N, Hk, R)``) float32.
    """
    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens.to(device=q.device, dtype=torch.int32).contiguous()
    return SelectiveRotaryTriton.apply(q, k, increment, temperature, initial_phase, cu_seqlens)
