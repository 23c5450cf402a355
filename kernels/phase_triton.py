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
one program per (sequence x key head, time chunk), walking its chunk in 16-token tiles; each tile recomputes the
projection of the K - 1 tokens before it (the convolution's window) rather than reading another program's. For the
fused op the chunks are the rotary scan's (``rotary_triton._plan``) and the kernel also writes each chunk's total
(the scan's pass 1), so the forward is this launch and the rotation's. The sums run in another order than the torch
path's matrix products: equal within float64 rounding, which the rounding to float32 absorbs
(``tests/kernels/test_phase_triton.py``).

``phase_increment_backward_triton`` (the fused op's backward, at the end of the file) is PROVISIONAL: a float64
PyTorch recompute through ``torch.func.vjp``, until its Triton version replaces it.
"""

from __future__ import annotations

import torch

from .rotary_triton import _add, _cdiv, _next_power_of_2, _sigmoid, _span, _sum0

try:  # (see rotary_triton: triton is optional, and this file may travel with saved models)
    import triton
    import triton.language as tl
except ImportError as error:
    raise ImportError("the Triton Selective RoPE kernels need `triton` (pip install triton)") from error

__all__ = ["phase_increment_backward_triton", "phase_increment_triton"]

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
def _increment_tile(x_ptr, down_ptr, up_ptr, conv_ptr, bias_ptr, gw_ptr, gb_ptr, state_ptr, b, n, hk, bos, ts,
                    mask_t, Hk, R, Dc, RANK, sx_b, sx_t, CONV_K: tl.constexpr, SILU: tl.constexpr,
                    HAS_BIAS: tl.constexpr, HAS_GATE: tl.constexpr, HAS_STATE: tl.constexpr,
                    BLOCK_T: tl.constexpr, BLOCK_DC: tl.constexpr, BLOCK_R: tl.constexpr):
    """The increments of tokens ``ts`` (key head ``hk`` of sequence ``n``, batch row ``b``, first token ``bos``):
    ``(BLOCK_T, BLOCK_R)`` float64, not yet rounded, zero where ``mask_t`` is False (padding, or past the tile)."""
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
    return tl.where(mask_t[:, None], c, 0.0)  # padding advances no phase


@triton.jit
def _phase_increment_kernel(
    x_ptr, down_ptr, up_ptr, conv_ptr, bias_ptr, gw_ptr, gb_ptr, lengths_ptr, cu_ptr, state_ptr, init_ptr, out_ptr,
    new_state_ptr, totals_ptr,
    T, Hk, R, Dc, RANK, NC, CHUNK,
    sx_b, sx_t,
    CONV_K: tl.constexpr, SILU: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_GATE: tl.constexpr,
    HAS_LENGTHS: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_STATE: tl.constexpr, WRITE_STATE: tl.constexpr,
    WRITE_TOTALS: tl.constexpr, HAS_INIT: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_DC: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr,
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
    for t0 in range(start, chunk_end, BLOCK_T):
        ts = t0 + tl.arange(0, BLOCK_T)
        c = _increment_tile(x_ptr, down_ptr, up_ptr, conv_ptr, bias_ptr, gw_ptr, gb_ptr, state_ptr, b, n, hk, bos,
                            ts, ts < real_end, Hk, R, Dc, RANK, sx_b, sx_t, CONV_K, SILU, HAS_BIAS, HAS_GATE,
                            HAS_STATE, BLOCK_T, BLOCK_DC, BLOCK_R).to(tl.float32)  # rounded once
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
    num_seqs, conv_k = _check_inputs(x, down, up, conv_weight, conv_activation, bias, gate_weight, gate_bias, lengths,
                                     cu_seqlens, conv_state)
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


def _check_inputs(x, down, up, conv_weight, conv_activation, bias, gate_weight, gate_bias, lengths, cu_seqlens,
                  conv_state) -> tuple[int, int]:
    """Refuses inputs that disagree (``phase_increment_triton``'s arguments); returns the number of sequences and of
    taps (0 without a convolution)."""
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
    return num_seqs, conv_k


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
    _phase_increment_kernel[(num_seqs * num_key_heads, chunks)](  # (chunk 0 writes the new history)
        x, _dense(down), _dense(up), _dense(conv_weight) if conv_weight is not None else placeholder,
        _dense(bias) if bias is not None else placeholder,
        _dense(gate_weight) if gate_weight is not None else placeholder,
        _dense(gate_bias) if gate_bias is not None else placeholder,
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
        BLOCK_T=_BLOCK_T, BLOCK_DC=_next_power_of_2(chunk_dim), BLOCK_R=_next_power_of_2(rotary_pairs),
        BLOCK_S=_next_power_of_2(max(conv_k - 1, 1)), num_warps=4,
    )


# --------------------------------------------------------------------------------------------------------------------
# PROVISIONAL (issue 46): the phase path's backward as a float64 PyTorch recompute through torch.func.vjp, so that the
# fused op (kernels/rotary_fused_triton.py) trains and is tested. To be replaced by the one-launch Triton backward with
# the same name and signature; nothing else depends on how it computes.
# --------------------------------------------------------------------------------------------------------------------
def _increments_torch(x, down, up, conv_weight, conv_activation, bias, gate_weight, gate_bias, lengths, cu_seqlens,
                      conv_state) -> torch.Tensor:
    """What ``_phase_increment_kernel`` computes, as ``SelectiveRotaryEmbedding.phase_increment`` computes it for the
    default phase path, in PyTorch: ``(B, T, Hk, R)`` float32 (computed in float64, rounded once)."""
    from .conv_torch import causal_conv1d

    batch, seq_len, _ = x.shape
    num_key_heads, _, chunk_dim = down.shape
    u = torch.nn.functional.normalize(x.to(torch.float64).view(batch, seq_len, num_key_heads, chunk_dim), dim=-1)
    low = torch.einsum("bthd,hkd->bthk", u, down.to(torch.float64))  # (B, T, Hk, rank)
    a = torch.einsum("bthk,hrk->bthr", low, up.to(torch.float64))  # (B, T, Hk, R)
    valid = None
    if lengths is not None:
        valid = (torch.arange(seq_len, device=x.device) < lengths.view(-1, 1))[..., None, None]  # (B, T, 1, 1)
        a = a * valid  # pads never enter the convolution history
    if conv_weight is not None:
        state = None if conv_state is None else conv_state.to(torch.float64)
        flat, _ = causal_conv1d(a.flatten(2), conv_weight.to(torch.float64), state, lengths, conv_activation,
                                cu_seqlens=cu_seqlens)
        a = flat.view_as(a)
    if bias is not None:
        a = a + bias.to(torch.float64).exp()
    if gate_weight is not None:
        logits = torch.nn.functional.linear(u.flatten(2), gate_weight.to(torch.float64), gate_bias.to(torch.float64))
        a = a * torch.sigmoid(logits)[..., None]  # (B, T, Hk, 1)
    if valid is not None:
        a = a * valid  # pads never advance the phase
    return a.float()


def phase_increment_backward_triton(
    grad_increment: torch.Tensor,
    x: torch.Tensor,
    down: torch.Tensor,
    up: torch.Tensor,
    conv_weight: torch.Tensor | None,
    conv_activation: str | None,
    bias: torch.Tensor | None,
    gate_weight: torch.Tensor | None,
    gate_bias: torch.Tensor | None,
    lengths: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    conv_state: torch.Tensor | None,
) -> tuple[torch.Tensor | None, ...]:
    """PROVISIONAL: the gradients of ``phase_increment_triton``'s increments (arguments as its own, and
    ``grad_increment`` ``(B, T, Hk, R)`` float32) with respect to ``(x, down, up, conv_weight, bias, gate_weight,
    gate_bias)``, each in its input's dtype (``None`` for an absent input). Recomputed in float64 PyTorch ops from the
    inputs (nothing of the forward is saved); the cached ``conv_state`` gets no gradient."""
    names = ("x", "down", "up", "conv_weight", "bias", "gate_weight", "gate_bias")
    given = dict(zip(names, (x, down, up, conv_weight, bias, gate_weight, gate_bias)))
    present = [name for name in names if given[name] is not None]

    def increments(*tensors):
        inputs = {**given, **dict(zip(present, tensors))}
        return _increments_torch(inputs["x"], inputs["down"], inputs["up"], inputs["conv_weight"], conv_activation,
                                 inputs["bias"], inputs["gate_weight"], inputs["gate_bias"], lengths, cu_seqlens,
                                 conv_state)

    primals = [given[name] for name in present]
    grad_increment = grad_increment.to(torch.float32)
    if torch._C._dispatch_tls_local_exclude_set().has(torch._C.DispatchKey.AutogradFunctionality):
        # Inside a custom op's function autograd is dispatched below: functorch's vjp works there (and costs more)
        _, pullback = torch.func.vjp(increments, *primals)
        grads = pullback(grad_increment)
    else:
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_() for t in primals]
            grads = torch.autograd.grad(increments(*leaves), leaves, grad_increment)
    return tuple(dict(zip(present, grads)).get(name) for name in names)
