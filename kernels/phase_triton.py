"""Selective RoPE's phase increments in Triton, for the default phase path: a first building block of issue 46's item 1
(the phase path inside the rotary op). Forward only, and no model calls it yet: the rotary module's Triton path still
computes the increments with PyTorch ops (``SelectiveRotaryEmbedding.phase_increment``).

``phase_increment_triton`` computes, for every token and key head, what ``phase_increment`` computes for a
``"low_rank"`` projection, the per-head gate (or none), a learned causal convolution (or none; its activation ``None``
or ``"silu"``) and the optional bias, continuing a cached convolution history or from a sequence start:

    u = chunk / max(‖chunk‖, 1e-12),  a = up_h (down_h u),  c = (act(conv(a)) + exp(b)) · sigmoid(w_h·u_all + g_h)

in float64, rounded once to float32, zero at padding (``lengths``, right-padded rows) and restarting at packed
sequences' boundaries (``cu_seqlens``), with the convolution's new history (the last K - 1 real inputs). One launch,
one program per (sequence x key head, time tile); each program recomputes the projection of the K - 1 tokens before
its tile (the convolution's window) rather than reading another program's. The sums run in another order than the
torch path's matrix products: equal within float64 rounding, which the rounding to float32 absorbs
(``tests/kernels/test_phase_triton.py``).

Not yet: the backward, the other projections and gates, and fusing it into the rotary scan's first pass (two
launches for the whole forward).
"""

from __future__ import annotations

import torch

from .rotary_triton import _add, _cdiv, _next_power_of_2, _sigmoid, _span

try:  # (see rotary_triton: triton is optional, and this file may travel with saved models)
    import triton
    import triton.language as tl
except ImportError as error:
    raise ImportError("the Triton Selective RoPE kernels need `triton` (pip install triton)") from error

__all__ = ["phase_increment_triton"]

_BLOCK_T = 16


# Reductions through our own combine function and zeros from tl.full, as in rotary_triton (its comment says why).
@triton.jit
def _sum1(x):
    return tl.reduce(x, 1, _add)


@triton.jit
def _normalized_chunk(x_ptr, b, ts, mask_t, chunk, sx_b, sx_t, Dc, BLOCK_DC: tl.constexpr):
    """``(BLOCK_T, BLOCK_DC)`` float64: input chunk ``chunk`` of tokens ``ts`` L2-normalised (zeros where masked)."""
    ds = tl.arange(0, BLOCK_DC)
    mask = mask_t[:, None] & (ds < Dc)[None, :]
    x = tl.load(x_ptr + b * sx_b + ts[:, None] * sx_t + chunk * Dc + ds[None, :], mask=mask, other=0.0)
    x = x.to(tl.float64)
    norm = tl.maximum(tl.sqrt(_sum1(x * x)), 1e-12)  # F.normalize's denominator
    return x / norm[:, None]


@triton.jit
def _projection(x_ptr, down_ptr, up_ptr, b, hk, ts, mask_t, sx_b, sx_t, Dc, RANK, R,
                BLOCK_T: tl.constexpr, BLOCK_DC: tl.constexpr, BLOCK_R: tl.constexpr):
    """``a = up_h (down_h u)`` of tokens ``ts``: ``(BLOCK_T, BLOCK_R)`` float64, zero where ``mask_t`` is False."""
    u = _normalized_chunk(x_ptr, b, ts, mask_t, hk, sx_b, sx_t, Dc, BLOCK_DC)
    ds = tl.arange(0, BLOCK_DC)
    rs = tl.arange(0, BLOCK_R)
    a = tl.full([BLOCK_T, BLOCK_R], 0.0, tl.float64)
    for k in range(RANK):  # one rank at a time: a (BLOCK_T, BLOCK_DC) tile, never a 3-D product
        down = tl.load(down_ptr + (hk * RANK + k) * Dc + ds, mask=ds < Dc, other=0.0).to(tl.float64)
        low = _sum1(u * down[None, :])
        up = tl.load(up_ptr + (hk * R + rs) * RANK + k, mask=rs < R, other=0.0).to(tl.float64)
        a += low[:, None] * up[None, :]
    return a


@triton.jit
def _phase_increment_kernel(
    x_ptr, down_ptr, up_ptr, conv_ptr, bias_ptr, gw_ptr, gb_ptr, lengths_ptr, cu_ptr, state_ptr, out_ptr,
    new_state_ptr,
    T, Hk, R, Dc, RANK,
    sx_b, sx_t,
    CONV_K: tl.constexpr, SILU: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_GATE: tl.constexpr,
    HAS_LENGTHS: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_STATE: tl.constexpr, WRITE_STATE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_DC: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr,
):
    pid_nh, pid_t = tl.program_id(0), tl.program_id(1)
    hk = pid_nh % Hk
    n = (pid_nh // Hk).to(tl.int64)
    b, bos, end = _span(pid_nh // Hk, cu_ptr, T, IS_VARLEN)
    ts = bos + pid_t.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    valid_end = end
    if HAS_LENGTHS:  # right-padded rows: tokens from the row's length on are padding
        valid_end = bos + tl.load(lengths_ptr + b).to(tl.int64)
    mask_t = ts < valid_end
    written = ts < end  # the tokens this program writes (zeros at padding)
    rs = tl.arange(0, BLOCK_R)
    mask_r = rs < R
    channels = Hk * R

    if CONV_K > 0:  # taps oldest first
        c = tl.full([BLOCK_T, BLOCK_R], 0.0, tl.float64)
        for j in tl.static_range(CONV_K):
            shifted = ts - (CONV_K - 1 - j)
            a = _projection(x_ptr, down_ptr, up_ptr, b, hk, shifted, (shifted >= bos) & mask_t, sx_b, sx_t, Dc,
                            RANK, R, BLOCK_T, BLOCK_DC, BLOCK_R)
            if HAS_STATE:  # before the sequence start: the cached history, slot K-1 - (bos - token)
                slot = shifted - bos + (CONV_K - 1)
                mask = (mask_t & (shifted < bos) & (slot >= 0))[:, None] & mask_r[None, :]
                a += tl.load(state_ptr + (n * (CONV_K - 1) + slot[:, None]) * channels + hk * R + rs[None, :],
                             mask=mask, other=0.0)
            tap = tl.load(conv_ptr + (hk * R + rs) * CONV_K + j, mask=mask_r, other=0.0).to(tl.float64)
            c += a * tap[None, :]
        if SILU:
            c = c * _sigmoid(c)
    else:
        c = _projection(x_ptr, down_ptr, up_ptr, b, hk, ts, mask_t, sx_b, sx_t, Dc, RANK, R, BLOCK_T, BLOCK_DC,
                        BLOCK_R)
    if HAS_BIAS:
        c += tl.exp(tl.load(bias_ptr + hk * R + rs, mask=mask_r, other=0.0).to(tl.float64))[None, :]
    if HAS_GATE:  # the per-head gate reads every chunk, each normalised by its own norm
        ds = tl.arange(0, BLOCK_DC)
        logit = tl.full([BLOCK_T], 0.0, tl.float64)
        for chunk in range(Hk):
            u = _normalized_chunk(x_ptr, b, ts, mask_t, chunk, sx_b, sx_t, Dc, BLOCK_DC)
            w = tl.load(gw_ptr + hk * Hk * Dc + chunk * Dc + ds, mask=ds < Dc, other=0.0).to(tl.float64)
            logit += _sum1(u * w[None, :])
        c *= _sigmoid(logit + tl.load(gb_ptr + hk).to(tl.float64))[:, None]
    c = tl.where(mask_t[:, None], c, 0.0)  # padding advances no phase
    # (B, T, Hk, R) float32, contiguous: rounded once
    offsets = ((b * T + ts[:, None]) * Hk + hk) * R + rs[None, :]
    tl.store(out_ptr + offsets, c.to(tl.float32), mask=written[:, None] & mask_r[None, :])

    if WRITE_STATE:  # the new history: the last K-1 inputs of the real tokens (continuing the cached one)
        if pid_t == 0:
            slots = tl.arange(0, BLOCK_S)
            tokens = valid_end - (CONV_K - 1) + slots
            in_slots = slots < CONV_K - 1
            # (names of their own: Triton keeps a variable's shape across branches, and these are (BLOCK_S, ...))
            last = _projection(x_ptr, down_ptr, up_ptr, b, hk, tokens, (tokens >= bos) & in_slots, sx_b, sx_t, Dc,
                               RANK, R, BLOCK_S, BLOCK_DC, BLOCK_R)
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
        conv_weight: ``(Hk * R, K)`` the convolution's taps (the last on the current token), or ``None``.
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
    batch, seq_len, hidden = x.shape
    num_key_heads, rank, chunk_dim = down.shape
    rotary_pairs = up.shape[1]
    if (hidden != num_key_heads * chunk_dim or up.shape != (num_key_heads, rotary_pairs, rank)
            or (conv_weight is not None and conv_weight.shape[0] != num_key_heads * rotary_pairs)
            or (bias is not None and bias.shape != (num_key_heads, rotary_pairs))
            or (gate_weight is not None and (gate_weight.shape != (num_key_heads, hidden) or gate_bias is None))):
        raise ValueError(f"x {tuple(x.shape)}, down {tuple(down.shape)}, up {tuple(up.shape)}, conv_weight "
                         f"{None if conv_weight is None else tuple(conv_weight.shape)}, bias "
                         f"{None if bias is None else tuple(bias.shape)} and gate weight "
                         f"{None if gate_weight is None else tuple(gate_weight.shape)} disagree")
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
    out = torch.empty(batch, seq_len, num_key_heads, rotary_pairs, dtype=torch.float32, device=x.device)
    new_state = None if conv_weight is None else x.new_empty(num_seqs, conv_k - 1, channels, dtype=torch.float64)
    if num_seqs == 0 or channels == 0:
        return out.zero_(), new_state
    x = x if x.stride(-1) == 1 else x.contiguous()
    if conv_state is not None:
        conv_state = conv_state.to(torch.float64).contiguous()
    placeholder = out  # for pointers a disabled branch never reads
    grid = (num_seqs * num_key_heads, max(_cdiv(seq_len, _BLOCK_T), 1))  # (tile 0 writes the new history)
    _phase_increment_kernel[grid](
        x, down.contiguous(), up.contiguous(),
        placeholder if conv_weight is None else conv_weight.contiguous(),
        placeholder if bias is None else bias.contiguous(),
        placeholder if gate_weight is None else gate_weight.contiguous(),
        placeholder if gate_bias is None else gate_bias.contiguous(),
        placeholder if lengths is None else lengths.to(device=x.device, dtype=torch.int64).contiguous(),
        placeholder if cu_seqlens is None else cu_seqlens.to(device=x.device, dtype=torch.int32).contiguous(),
        placeholder if conv_state is None else conv_state, out, placeholder if new_state is None else new_state,
        seq_len, num_key_heads, rotary_pairs, chunk_dim, rank, x.stride(0), x.stride(1),
        CONV_K=conv_k, SILU=conv_activation == "silu",
        HAS_BIAS=bias is not None, HAS_GATE=gate_weight is not None, HAS_LENGTHS=lengths is not None,
        IS_VARLEN=cu_seqlens is not None, HAS_STATE=conv_state is not None, WRITE_STATE=conv_k > 1,
        BLOCK_T=_BLOCK_T, BLOCK_DC=_next_power_of_2(chunk_dim), BLOCK_R=_next_power_of_2(rotary_pairs),
        BLOCK_S=_next_power_of_2(max(conv_k - 1, 1)), num_warps=4,
    )
    return out, new_state
