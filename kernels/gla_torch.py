"""Pure-PyTorch Gated Linear Attention (GLA): the CPU backend of the GLA op.

Layout follows flash-linear-attention (fla): every sequence tensor is ``[B, T, H, D]``.
Per batch and head the op runs the recurrence

    S_t = diag(exp(gk_t)) S_{t-1} + k_t v_tᵀ        S: (K, V), gk_t <= 0 (log decay per key dim)
    o_t = S_tᵀ (q_t * scale)

All math is done in float32 whatever the input dtype; outputs come back in ``q.dtype`` and the
final state in float32.

``recurrent_gla`` is the plain per-token loop (decoding, where T is usually 1).

``chunk_gla`` is chunk-parallel (prefill and training). With ``decay(a -> b)`` the product of
``exp(gk)`` over the tokens after ``a`` up to ``b``:

* Inside each chunk (all chunks at once) the causal part is built bottom-up as a binary tree:
  neighbouring blocks of ``n`` tokens are merged into blocks of ``2n``. Every token s of the first
  block reaches every token t of the second through the boundary between them,
  ``(q_t * decay(boundary -> t)) · (k_s * decay(s -> boundary))``: one small matmul per pair of
  blocks. Each block carries q decayed from its start, k decayed to its end and its total decay;
  a merge extends them by multiplying with the other block's total decay. After ``log2(C)``
  merges q is decayed from the chunk start and k to the chunk end, which is what the next step
  needs.
* Between chunks, a short Python loop carries the (K, V) state,
  ``S_next = decay(chunk) * S + (k * decay(s -> chunk end))ᵀ @ v``, and every chunk reads its
  start state with ``(q * decay(chunk start -> t)) @ S_start`` in one batched matmul.
* Long inputs run as consecutive segments of a few chunks (see ``SEGMENT_ELEMENTS``).

Why it is stable: every decay is a product of factors ``exp(gk) <= 1``. Nothing is divided by a
decay and no exponent is ever positive (the only ``exp`` is of ``gk`` itself), so nothing can
overflow however strong the decay (gk = -30 per step, or even -inf). A product may underflow to
0, but then the true weight is smaller still.

Why not fla's sub-chunk scheme (exp of cumulative-decay differences, pairwise inside 16-token
sub-chunks)? It is equally stable and as accurate, but this needs a single ``exp`` per element
(an ``exp`` costs about ten multiplies on a CPU) and no (16 x 16 x K) pairwise tensors; on 2 CPU
cores it measured as fast at T=512 and about 10% faster at T=2048.

Any T works: the end is padded with q = k = v = 0 and gk = 0 (no decay, nothing written),
which leaves the outputs and the final state unchanged, and the output is sliced back.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .segments import check_chunk_size, segment_slices

# Float32 elements per (B, H, tokens, D) temporary of one segment (512 KiB); see kernels/segments.py.
SEGMENT_ELEMENTS = 2**17


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
        chunk_size: tokens per chunk, a power of two.

    Returns:
        o: (B, T, H, V) in q.dtype, and the final state (B, H, K, V) in float32, or None.
    """
    check_chunk_size(chunk_size)
    B, T, H, K = q.shape
    scale = K**-0.5 if scale is None else scale
    state = None if initial_state is None else initial_state.float()

    outputs = []
    for part in segment_slices(T, chunk_size, B * H * chunk_size * max(K, v.shape[-1]), SEGMENT_ELEMENTS):
        o, state = _chunk_gla_segment(q[:, part], k[:, part], v[:, part], gk[:, part], scale, state, chunk_size)
        outputs.append(o)
    o = torch.cat(outputs, dim=1)  # (B, T, H, V)
    return o.to(q.dtype), state if output_final_state else None


def _chunk_gla_segment(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gk: torch.Tensor,
    scale: float,
    state: torch.Tensor | None,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`chunk_gla` on one segment: (B, T, H, *) inputs, float32 (B, H, K, V) state in (or None) and out.

    Returns the float32 output (B, T, H, V) and the state after the segment.
    """
    T = q.shape[1]
    chunk_size = min(chunk_size, 1 << (T - 1).bit_length())  # a short input needs no longer chunk

    # (B, T, H, D) -> (B, H, N, C, D), float32, zero-padded to a whole number of chunks
    q, k, v, gk = (_to_chunks(x, chunk_size) for x in (q, k, v, gk))
    o, q_in, k_out, chunk_decay = _intra_chunk(q * scale, k, v, gk.exp())
    start_states, state = _chunk_states(k_out, v, chunk_decay, state)  # (B, H, N, K, V), (B, H, K, V)
    o = o + q_in @ start_states  # what each chunk reads from the state it starts with

    return o.flatten(2, 3)[:, :, :T].transpose(1, 2), state  # (B, H, N*C, V) -> (B, T, H, V)


def _to_chunks(x: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """(B, T, H, D) -> (B, H, N, C, D) in float32, the end padded with zeros to N * C tokens."""
    B, T, H, D = x.shape
    n_chunks = -(-T // chunk_size)
    x = x.float().transpose(1, 2)  # (B, H, T, D)
    # zero q/k/v read and write nothing; zero gk means "no decay", so the padding changes nothing
    x = F.pad(x, (0, 0, 0, n_chunks * chunk_size - T))  # (B, H, N*C, D)
    return x.view(B, H, n_chunks, chunk_size, D)


def _intra_chunk(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Causal GLA inside each chunk, by merging neighbouring blocks of 1, 2, 4, ... tokens.

    q (already scaled), k: (..., C, K); v: (..., C, V); g = exp(gk): (..., C, K).
    Returns:
        o: (..., C, V), the output from the tokens of the same chunk;
        q_in: (..., C, K), q_t * decay(chunk start -> t), t's own decay included;
        k_out: (..., C, K), k_s * decay(s -> chunk end), s's own decay excluded;
        chunk_decay: (..., 1, K), the decay over the whole chunk.
    """
    # blocks of one token: o_t = (q_t . k_t) v_t; the decay into t is g_t, out of t there is none
    o = (q * k).sum(-1, keepdim=True) * v
    q_in, k_out, block_decay = q * g, k, g  # block_decay: (..., C / size, K), one row per block
    size = 1
    while size < q.shape[-2]:
        o, q_in, k_out, block_decay = _merge_blocks(v, o, q_in, k_out, block_decay, size)
        size *= 2
    return o, q_in, k_out, block_decay


def _merge_blocks(
    v: torch.Tensor,
    o: torch.Tensor,
    q_in: torch.Tensor,
    k_out: torch.Tensor,
    block_decay: torch.Tensor,
    size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Merge each pair of neighbouring blocks of `size` tokens (first, second) into one block.

    v, o, q_in, k_out: (..., C, D); block_decay: (..., C / size, K). On entry o, q_in, k_out and
    block_decay are those of each block of `size` tokens alone (o: the output from inside the block,
    q_in: q decayed from the block start, k_out: k decayed to the block end), on return those of
    the merged blocks of 2 * size tokens.
    """

    def halves(x: torch.Tensor, rows_per_block: int = size) -> tuple[torch.Tensor, torch.Tensor]:
        # (..., C, D) -> 2 x (..., M, rows_per_block, D): the first and the second block of each pair
        return x.unflatten(-2, (-1, 2, rows_per_block)).unbind(-3)

    def join(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
        # 2 x (..., M, size, D) -> (..., C, D)
        return torch.stack([first, second], dim=-3).flatten(-4, -2)

    (v1, _), (o1, o2), (q1, q2), (k1, k2) = halves(v), halves(o), halves(q_in), halves(k_out)
    decay1, decay2 = halves(block_decay, rows_per_block=1)  # 2 x (..., M, 1, K)

    # first -> second, through the boundary between them: q decayed from it, k decayed to it
    scores = _small_matmul(q2, k1.transpose(-1, -2))  # (..., M, size, size)
    o = join(o1, o2 + _small_matmul(scores, v1))

    # extend the decays over the merged block by the other block's total decay
    q_in = join(q1, q2 * decay1)
    k_out = join(k1 * decay2, k2)
    return o, q_in, k_out, (decay1 * decay2).flatten(-3, -2)


def _small_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b. For 1- or 2-row blocks a broadcast multiply-sum beats the CPU batched matmul."""
    if a.shape[-2] <= 2:
        return (a.unsqueeze(-1) * b.unsqueeze(-3)).sum(-2)
    return a @ b


def _chunk_states(
    k_out: torch.Tensor, v: torch.Tensor, chunk_decay: torch.Tensor, initial_state: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """State at the start of every chunk, and after the last one.

    k_out: (B, H, N, C, K), k decayed to the chunk end; v: (B, H, N, C, V);
    chunk_decay: (B, H, N, 1, K); initial_state: float32 (B, H, K, V) or None.
    Returns the (B, H, N, K, V) start states and the (B, H, K, V) final state, float32.
    """
    B, H, _, _, K = k_out.shape
    updates = k_out.transpose(-1, -2) @ v  # (B, H, N, K, V): what each chunk adds, all chunks at once
    chunk_decay = chunk_decay.transpose(-1, -2)  # (B, H, N, K, 1)

    state = k_out.new_zeros(B, H, K, v.shape[-1]) if initial_state is None else initial_state
    starts = []
    for decay, update in zip(chunk_decay.unbind(2), updates.unbind(2)):  # only this is sequential
        starts.append(state)
        state = torch.addcmul(update, decay, state)  # decay * state + update
    return torch.stack(starts, dim=2), state


def recurrent_gla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gk: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    in_place: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token GLA (decoding, where T is usually 1).

    Args:
        q, k: (B, T, H, K) queries and keys.
        v: (B, T, H, V) values.
        gk: (B, T, H, K) log decay per key dim (<= 0).
        scale: query scale; defaults to K ** -0.5.
        initial_state: (B, H, K, V) state before the first token, any float dtype (used as float32).
        output_final_state: also return the state after the last token.
        in_place: update ``initial_state`` itself, when it is float32, and return it as the final state (a static
            cache's state, whose address must not change); the same values as a new state.

    Returns:
        o: (B, T, H, V) in q.dtype, and the final state (B, H, K, V) in float32, or None.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    out_dtype = q.dtype
    scale = K**-0.5 if scale is None else scale
    q, k, v, gk = (x.float() for x in (q, k, v, gk))
    q, decay = q * scale, gk.exp()
    state = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.float()
    in_place = in_place and state is initial_state  # (.float() of a float32 tensor is the tensor itself)

    outputs = []
    for t in range(T):
        # (B, H, K, 1) * (B, H, K, V) + (B, H, K, 1) * (B, H, 1, V) -> (B, H, K, V)
        update = k[:, t, :, :, None] * v[:, t, :, None, :]
        if in_place:  # the same two roundings as out of place
            state.mul_(decay[:, t, :, :, None]).add_(update)
        else:
            state = decay[:, t, :, :, None] * state + update
        outputs.append(q[:, t, :, None, :] @ state)  # (B, H, 1, K) @ (B, H, K, V) -> (B, H, 1, V)
    o = torch.cat(outputs, dim=2).transpose(1, 2)  # (B, H, T, V) -> (B, T, H, V)
    return o.to(out_dtype), state if output_final_state else None
