"""Pure-PyTorch Gated Linear Attention (GLA): the CPU backend of the GLA op.

Layout follows flash-linear-attention (fla): every sequence tensor is ``[B, T, H, D]``.
Per batch ``b`` and head ``h`` the op runs the recurrence

    S_t = diag(exp(gk_t)) S_{t-1} + k_t v_tᵀ        S: (K, V), gk_t <= 0 (log decay per key dim)
    o_t = S_tᵀ (q_t * scale)

All math is done in float32 whatever the input dtype; outputs come back in ``q.dtype`` and the
final state in float32.

``recurrent_gla`` is the plain per-token loop (decoding, where T is usually 1).

``chunk_gla`` is chunk-parallel (prefill and training). Design, with ``b`` the cumulative sum
of ``gk`` inside a chunk (``b <= 0`` and non-increasing along time, per key dim):

* Intra-chunk work is batched over all chunks at once. The attention weight
  ``A[t, s] = sum_d q_td k_sd exp(b_td - b_sd)`` (s <= t) is built from 16-token sub-chunks:
  - off-diagonal blocks (target sub-chunk i > source sub-chunk j) use the reference
    ``r_i`` = ``b`` just before sub-chunk i starts:
    ``A_ij = (q_i * exp(b_i - r_i)) @ (k_j * exp(r_i - b_j))ᵀ``. Time only moves forward
    from j to r_i to i, so both exponents are <= 0;
  - diagonal blocks use the pairwise (16 x 16 x K) form ``exp(b_t - b_s)``, with s > t
    masked to -inf *before* the exp.
* Inter-chunk: a short Python loop over chunks carries the state,
  ``S_next = exp(b_last) * S + (k * exp(b_last - b))ᵀ @ v``, and every chunk then reads
  its start state through ``(q * exp(b)) @ S_start`` in one batched matmul.

Why it is stable: no exponent is ever positive, so no ``exp`` can overflow, however strong the
decay (e.g. gk = -30 per step). A factor may underflow to 0, but each factor bounds the true
product ``exp(b_t - b_s)`` from above, so what is lost is smaller still. Masked positions are
removed before the exp, so autograd never sees ``inf`` either (no NaN gradients).

Any T works: the end is padded with q = k = v = 0 and gk = 0 (no decay, nothing written),
which leaves the outputs and the final state unchanged, and the output is sliced back.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

SUB_CHUNK = 16  # tokens per sub-chunk; the pairwise (diagonal-block) form is only used at this size



def chunk_gla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gk: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunk-parallel GLA (prefill / training), numerically stable for any decay strength.

    Args:
        q, k: (B, T, H, K) queries and keys.
        v: (B, T, H, V) values.
        gk: (B, T, H, K) log decay per key dim (<= 0).
        scale: query scale; defaults to K ** -0.5.
        initial_state: (B, H, K, V) state before the first token, any float dtype (used as float32).
        output_final_state: also return the state after the last token.
        chunk_size: tokens per chunk, a multiple of SUB_CHUNK (16).

    Returns:
        o: (B, T, H, V) in q.dtype, and the final state (B, H, K, V) in float32, or None.
    """
    if chunk_size % SUB_CHUNK:
        raise ValueError(f"chunk_size must be a multiple of {SUB_CHUNK}, got {chunk_size}")
    B, T, H, K = q.shape
    out_dtype = q.dtype
    scale = K**-0.5 if scale is None else scale

    # (B, T, H, D) -> (B, H, N, C, D), float32, zero-padded to a whole number of chunks
    q, k, v, gk = (_to_chunks(x, chunk_size) for x in (q, k, v, gk))
    q = q * scale
    b = gk.cumsum(-2)  # (B, H, N, C, K): decay from the chunk start, <= 0 and non-increasing

    o = _intra_chunk(q, k, v, b)  # (B, H, N, C, V)
    start_states, final_state = _chunk_states(k, v, b, initial_state)  # (B, H, N, K, V), (B, H, K, V)
    o = o + (q * b.exp()) @ start_states  # what each chunk reads from the state it starts with

    o = o.flatten(2, 3)[:, :, :T].transpose(1, 2)  # (B, H, N*C, V) -> (B, T, H, V)
    return o.to(out_dtype), final_state if output_final_state else None


def _to_chunks(x: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """(B, T, H, D) -> (B, H, N, C, D) in float32, the end padded with zeros to N * C tokens."""
    B, T, H, D = x.shape
    n_chunks = -(-T // chunk_size)
    x = x.float().transpose(1, 2)  # (B, H, T, D)
    # zero q/k/v write and read nothing; zero gk means "no decay", so padding changes nothing
    x = F.pad(x, (0, 0, 0, n_chunks * chunk_size - T))  # (B, H, N*C, D)
    return x.view(B, H, n_chunks, chunk_size, D)


def _intra_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Causal attention inside each chunk, A[t, s] = sum_d q_td k_sd exp(b_td - b_sd) for s <= t.

    q, k, b: (..., C, K); v: (..., C, V). Returns A @ v: (..., C, V).
    """
    *batch, C, K = q.shape
    n_sub = C // SUB_CHUNK
    # (..., C, K) -> (..., S, c, K): S sub-chunks of c tokens
    qs, ks, bs = (x.view(*batch, n_sub, SUB_CHUNK, K) for x in (q, k, b))

    a_diag = _diagonal_blocks(qs, ks, bs)  # (..., S, c, c)
    a_off = _off_diagonal_blocks(qs, ks, bs)  # (..., S_i, S_j, c, c), zero unless j < i
    on_diagonal = torch.eye(n_sub, dtype=torch.bool, device=q.device)[:, :, None, None]
    a = torch.where(on_diagonal, a_diag.unsqueeze(-3), a_off)  # (..., S_i, S_j, c, c)
    a = a.transpose(-3, -2).reshape(*batch, C, C)  # (..., S_i, c, S_j, c) -> (..., C, C)
    return a @ v


def _diagonal_blocks(qs: torch.Tensor, ks: torch.Tensor, bs: torch.Tensor) -> torch.Tensor:
    """Pairwise form inside each sub-chunk. qs, ks, bs: (..., S, c, K) -> (..., S, c_t, c_s)."""
    c = qs.shape[-2]
    causal = torch.ones(c, c, dtype=torch.bool, device=qs.device).tril()[:, :, None]  # (c_t, c_s, 1)
    log_decay = bs.unsqueeze(-2) - bs.unsqueeze(-3)  # (..., S, c_t, c_s, K): b_t - b_s
    # s > t would give a positive exponent: mask it before the exp, not after
    decay = torch.where(causal, log_decay, float("-inf")).exp()
    # (..., S, c_t, c_s, K) @ (..., S, c_t, K, 1) -> (..., S, c_t, c_s)
    return ((decay * ks.unsqueeze(-3)) @ qs.unsqueeze(-1)).squeeze(-1)


def _off_diagonal_blocks(qs: torch.Tensor, ks: torch.Tensor, bs: torch.Tensor) -> torch.Tensor:
    """Blocks from an earlier source sub-chunk j to a later target sub-chunk i.

    qs, ks, bs: (..., S, c, K) -> (..., S_i, S_j, c_t, c_s), zero where j >= i.
    """
    n_sub = qs.shape[-3]
    # r_i: b just before sub-chunk i starts (0 at the chunk start); (..., S, K)
    ref = torch.cat([torch.zeros_like(bs[..., :1, -1, :]), bs[..., :-1, -1, :]], dim=-2)
    q_dec = qs * (bs - ref.unsqueeze(-2)).exp()  # (..., S_i, c, K): decay r_i -> t, exponent <= 0
    # (..., S_i, 1, 1, K) - (..., 1, S_j, c, K) -> (..., S_i, S_j, c, K): decay s -> r_i
    log_decay = ref[..., :, None, None, :] - bs.unsqueeze(-4)
    earlier = torch.ones(n_sub, n_sub, dtype=torch.bool, device=qs.device).tril(-1)[:, :, None, None]
    # only j < i has a non-positive exponent; the rest is masked before the exp
    k_dec = ks.unsqueeze(-4) * torch.where(earlier, log_decay, float("-inf")).exp()  # (..., S_i, S_j, c, K)
    # (..., S_i, 1, c_t, K) @ (..., S_i, S_j, K, c_s) -> (..., S_i, S_j, c_t, c_s)
    return q_dec.unsqueeze(-3) @ k_dec.transpose(-1, -2)


def _chunk_states(
    k: torch.Tensor, v: torch.Tensor, b: torch.Tensor, initial_state: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """State at the start of every chunk, and after the last one.

    k, b: (B, H, N, C, K); v: (B, H, N, C, V); initial_state: (B, H, K, V) or None.
    Returns (B, H, N, K, V) start states and the (B, H, K, V) final state, float32.
    """
    B, H, N, C, K = k.shape
    b_last = b[..., -1, :]  # (B, H, N, K): decay over the whole chunk
    # what each chunk adds to the state, decayed to the chunk end (exponent <= 0), all chunks at once
    k_dec = k * (b_last.unsqueeze(-2) - b).exp()  # (B, H, N, C, K)
    updates = k_dec.transpose(-1, -2) @ v  # (B, H, N, K, V)
    chunk_decay = b_last.exp().unsqueeze(-1)  # (B, H, N, K, 1)

    state = k.new_zeros(B, H, K, v.shape[-1]) if initial_state is None else initial_state.float()
    starts = []
    for n in range(N):  # only this small (K x V) recurrence is sequential
        starts.append(state)
        state = chunk_decay[:, :, n] * state + updates[:, :, n]
    return torch.stack(starts, dim=2), state


def recurrent_gla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gk: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token GLA (decoding, where T is usually 1).

    Args:
        q, k: (B, T, H, K) queries and keys.
        v: (B, T, H, V) values.
        gk: (B, T, H, K) log decay per key dim (<= 0).
        scale: query scale; defaults to K ** -0.5.
        initial_state: (B, H, K, V) state before the first token, any float dtype (used as float32).
        output_final_state: also return the state after the last token.

    Returns:
        o: (B, T, H, V) in q.dtype, and the final state (B, H, K, V) in float32, or None.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    out_dtype = q.dtype
    scale = K**-0.5 if scale is None else scale
    q, k, v, gk = (x.float() for x in (q, k, v, gk))
    state = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.float()

    outputs = []
    for t in range(T):
        # (B, H, K, 1) * (B, H, K, V) + (B, H, K, 1) * (B, H, 1, V) -> (B, H, K, V)
        state = gk[:, t, :, :, None].exp() * state + k[:, t, :, :, None] * v[:, t, :, None, :]
        # (B, H, 1, K) @ (B, H, K, V) -> (B, H, 1, V)
        outputs.append((q[:, t, :, None, :] * scale) @ state)
    o = torch.cat(outputs, dim=2).transpose(1, 2) if T else q.new_zeros(B, 0, H, V)  # (B, T, H, V)
    return o.to(out_dtype), state if output_final_state else None
