"""Pure-PyTorch gated delta rule (Gated DeltaNet): the CPU backend of the Gated DeltaNet op.

Layout follows flash-linear-attention (fla): every sequence tensor is ``[B, T, H, D]``, the state is
``[B, H, K, V]``. Per batch and head the op runs fla's recurrence (``naive_recurrent_gated_delta_rule``)

    S_t = exp(g_t) (I - β_t k_t k_tᵀ) S_{t-1} + β_t k_t v_tᵀ      S: (K, V), g_t <= 0 (log decay), β_t in [0, 2)
    o_t = S_tᵀ (q_t * scale)

i.e. decay the state, read what it predicts for k_t, write β_t times the error towards v_t. q and k are
expected L2-normalised (the caller does it; nothing here normalises). All math is done in float32 whatever
the input dtype; outputs come back in ``v.dtype`` (as fla's kernels do) and the final state in float32.

``recurrent_gated_delta_rule`` is the plain per-token loop (decoding, where T is usually 1).

``chunk_gated_delta_rule`` is chunk-parallel (prefill and training), in the WY / UT-transform form of the
Gated DeltaNet paper (and fla's ``naive_chunk_gated_delta_rule``). Inside a chunk of C tokens, with
``γ_t = exp(g_1 + ... + g_t)`` the decay from the chunk start to t and ``γ_t / γ_s`` the decay from s to t:

* The state at t is ``S_t = γ_t S_0 + Σ_{s<=t} (γ_t / γ_s) k_s u_sᵀ`` for "new values" u solving
  ``(I + A) u = β v - β γ k S_0``, where ``A[t, s] = β_t (γ_t / γ_s) (k_t · k_s)`` for s < t. So
  ``u = U - W S_0`` with ``U = T (β v)``, ``W = T (β γ k)`` and ``T = (I + A)⁻¹``, which does not depend on
  ``S_0``: all chunks compute U and W at once. The unit lower triangular inverse is built by merging
  diagonal blocks 2 -> 4 -> ... -> C (``[[T₁, 0], [-T₂ A₂₁ T₁, T₂]]``): log2(C) - 1 batched matmul steps.
* Between chunks, a short Python loop carries the (K, V) state: ``u = U - W S_0``,
  ``S_C = γ_C S_0 + Σ_s (k_s γ_C / γ_s) u_sᵀ`` (two small matmuls per chunk).
* Every chunk then reads its output in two batched matmuls, ``o = (q γ) S_0 + (q kᵀ ∘ decay) u``.
* Long inputs run as consecutive segments of a few chunks (see ``SEGMENT_ELEMENTS``).

Why it is stable: every decay is ``exp`` of a difference of within-chunk cumulative log decays taken in
the causal direction (later minus earlier), so every exponent is <= 0 and every factor <= 1; the
anti-causal entries are masked to -inf *before* the ``exp``. Nothing is divided by a decay, so strong decay
(g = -20 per step or below) can underflow a weight to 0 but never overflow. The cumulative sums and their
differences are taken in float64 and only then rounded to float32: in float32 a difference of two large
cumulative sums (say -1000 after a strongly decaying token) loses the small decays between later tokens to
cancellation (per-step decays of 1e-2 come out ~1e-3 wrong there; with g in [-20, -5] a float32 version,
such as transformers' ``torch_chunk_gated_delta_rule``, ends up ~40x further from a float64 reference than
this one); in float64 every factor is exact to float32 rounding. g is clamped at -1e4 (exp(-1e4) is 0 in
float32 anyway, and no gradient flows below it) so that g = -inf (forget everything) gives 0, not nan.
The UT inverse stays bounded for β in [0, 2) (it encodes products of the contractions I - β k kᵀ), and
block merging is a stable way to invert a triangular matrix (no Neumann series, whose powers of A grow
combinatorially when β is near 2). The chunk form does lose more than the per-token loop in the worst case
(β near 2 with near-parallel keys and no decay: errors ~1e-4 against ~1e-5, as with transformers' chunked
version); with β <= 1 both are at float32 rounding.

Any T works: the end is padded with q = k = v = 0, g = 0 and β = 0, which makes the padded steps exact
identities (the state is multiplied by exp(0) = 1 and receives β = 0 times the error), and the output is
sliced back. The caller's own padding convention (β = 0 and g = 0 at padded positions, any q, k, v) is
exact in the same way, in both ops: the state passes such positions bit for bit unchanged. The chunk grid
depends only on ``chunk_size`` (a short input is not given a shorter chunk), so a right-padded sequence and
the same sequence unpadded go through the same per-chunk arithmetic (the tests check the final states are
bit-identical).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .segments import check_chunk_size, segment_slices

# Float32 elements per (B, H, tokens, D) or (B, H, tokens, C) temporary of one segment (1 MiB); see
# kernels/segments.py.
SEGMENT_ELEMENTS = 2**18

# Log decays are clamped here: exp(-1e4) is 0 in float32, and -inf would give inf - inf = nan in a difference.
MIN_LOG_DECAY = -1e4


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunk-parallel gated delta rule (prefill / training), numerically stable for any decay strength.

    Args:
        q, k: (B, T, H, K) queries and keys, L2-normalised over K by the caller.
        v: (B, T, H, V) values.
        g: (B, T, H) log decay (<= 0) of the state at each step.
        beta: (B, T, H) write strength, in [0, 1], or [0, 2) with negative eigenvalues allowed.
        scale: query scale; defaults to K ** -0.5.
        initial_state: (B, H, K, V) state before the first token, any float dtype (used as float32).
        output_final_state: also return the state after the last token.
        chunk_size: tokens per chunk, a power of two.

    Returns:
        o: (B, T, H, V) in v.dtype, and the final state (B, H, K, V) in float32, or None.
    """
    check_chunk_size(chunk_size)
    B, T, H, K = q.shape
    scale = K**-0.5 if scale is None else scale
    state = None if initial_state is None else initial_state.float().reshape(B * H, K, v.shape[-1])

    outputs = []
    for part in segment_slices(T, chunk_size, B * H * chunk_size * max(K, v.shape[-1]), SEGMENT_ELEMENTS):
        o, state = _chunk_segment(
            q[:, part], k[:, part], v[:, part], g[:, part], beta[:, part], scale, state, chunk_size
        )
        outputs.append(o)
    o = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)  # (B, T, H, V)
    return o.to(v.dtype).contiguous(), state.view(B, H, K, -1) if output_final_state else None


def _chunk_segment(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    state: torch.Tensor | None,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`chunk_gated_delta_rule` on one segment: (B, T, H, *) inputs, float32 (B*H, K, V) state in (or None) and out.

    Returns the float32 output (B, T, H, V) and the state after the segment.
    """
    B, T, H, _ = q.shape
    # (B, T, H, *D) -> (N * B*H, C, *D), float32, zero-padded to a whole number of chunks; the chunk index leads
    q, k, v, g, beta = (_to_chunks(x, chunk_size) for x in (q, k, v, g, beta))
    n_chunks = q.shape[0] // (B * H)

    decay, gamma_in, gamma_out = _decays(g)  # (..., C, C), (..., C), (..., C)
    k_t = k.transpose(-1, -2)
    no_input = q.new_zeros(())  # baddbmm with beta=0: a @ b scaled by alpha, the input ignored

    # UT transform: T = (I + A)^-1 with A[t, s] = β_t (γ_t / γ_s) k_t·k_s below the diagonal (what it is above
    # does not matter); built from -A, which saves a negation at every merge
    k_beta = k * beta[..., None]
    inverse = _unit_lower_inverse_from_negated(torch.baddbmm(no_input, k_beta, k_t, beta=0, alpha=-1) * decay)
    new_values = torch.bmm(inverse, v * beta[..., None])  # U = T (β v): (..., C, V)
    state_keys = torch.bmm(inverse, k_beta * gamma_in[..., None])  # W = T (β γ k): (..., C, K)

    # (q_t · k_s) scale γ_t / γ_s for s <= t, 0 above the diagonal
    scores = torch.baddbmm(no_input, q, k_t, beta=0, alpha=scale) * decay
    starts, u, state = _chunk_states(
        new_values, state_keys, k * gamma_out[..., None], gamma_in[:, -1], state, n_chunks
    )
    # o_t = S_0ᵀ q_t scale γ_t + Σ_s scores[t, s] u_s, (N * B*H, C, V)
    o = torch.baddbmm(torch.bmm(scores, u), q * (gamma_in * scale)[..., None], starts)

    o = o.view(n_chunks, B, H, chunk_size, -1).permute(1, 0, 3, 2, 4)  # (B, N, C, H, V)
    return o.reshape(B, n_chunks * chunk_size, H, -1)[:, :T], state


def _to_chunks(x: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """(B, T, H, *D) -> (N * B*H, C, *D) in float32 (chunk index outermost), the end padded with zeros to N * C."""
    B, T, H = x.shape[:3]
    n_chunks = -(-T // chunk_size)
    # zero q/k/v read and write nothing; zero β writes nothing; zero g means "no decay": the padding changes nothing
    x = F.pad(x.float(), (0, 0) * (x.dim() - 3) + (0, 0, 0, n_chunks * chunk_size - T))  # (B, N*C, H, *D)
    x = x.view(B, n_chunks, chunk_size, H, *x.shape[3:]).movedim(2, 3)  # (B, N, H, C, *D)
    return x.transpose(0, 1).reshape(n_chunks * B * H, chunk_size, *x.shape[4:])


def _decays(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Within-chunk decays from the log decays g: (..., C), float32.

    Returns, all float32 and <= 1:
        decay: (..., C, C), ``γ_t / γ_s`` for s <= t (1 on the diagonal), 0 above the diagonal;
        gamma_in: (..., C), ``γ_t``, the decay from the chunk start to t, t's own decay included;
        gamma_out: (..., C), ``γ_C / γ_s``, the decay from s to the chunk end, s's own decay excluded.
    """
    chunk_size = g.shape[-1]
    # float64 cumulative sums and differences: exact to float32 rounding however large the sums grow
    log_gamma = g.clamp(min=MIN_LOG_DECAY).double().cumsum(-1)
    log_decay = (log_gamma[..., :, None] - log_gamma[..., None, :]).float()  # (t, s): <= 0 for s <= t
    anticausal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=g.device).triu(1)
    decay = log_decay.masked_fill(anticausal, float("-inf")).exp()  # masked before exp: no positive exponent
    gamma_in = log_gamma.float().exp()
    gamma_out = (log_gamma[..., -1:] - log_gamma).float().exp()
    return decay, gamma_in, gamma_out


def _unit_lower_inverse_from_negated(a: torch.Tensor) -> torch.Tensor:
    """(I + L)^-1 for -L the strictly lower triangle of a: (n, C, C), C a power of two (the rest of a is ignored).

    The inverse is block lower triangular at every scale, so it is built bottom-up by merging neighbouring
    diagonal blocks (T₁, T₂) of size b into one of size 2b, ``[[T₁, 0], [T₂ (-L₂₁) T₁, T₂]]`` (-L₂₁: the block of
    a below T₁, left of T₂), starting from the 2 x 2 blocks ``[[1, 0], [-L₂₁, 1]]``: log2(C) steps, each a pair
    of batched matmuls over all pairs of blocks of all chunks. (``torch.linalg.solve_triangular`` against the
    identity is as fast, but loses 2-3x more accuracy in the hardest cases, β near 2 with near-parallel keys.)
    """
    n, C, _ = a.shape
    if C == 1:
        return a.new_ones(n, 1, 1)
    below = a.diagonal(offset=-1, dim1=-2, dim2=-1)[:, ::2]  # (n, C / 2): the -L₂₁ of the 2 x 2 blocks
    one, zero = torch.ones_like(below), torch.zeros_like(below)
    inverse = torch.stack([one, zero, below, one], dim=-1)  # (n, C / 2, 4): the 2 x 2 diagonal blocks
    size = 2
    while size < C:
        pairs = C // (2 * size)
        # the lower left quarters of the diagonal blocks of size 2b of a: (n * M, b, b)
        blocks = a.view(n, pairs, 2 * size, pairs, 2 * size).diagonal(dim1=1, dim2=3)  # (n, 2b, 2b, M)
        quarters = blocks[:, size:, :size].movedim(-1, 1).reshape(n * pairs, size, size)
        first, second = inverse.view(n * pairs, 2, size, size).unbind(1)
        below = torch.bmm(torch.bmm(second, quarters), first)
        inverse = torch.cat([F.pad(first, (0, size)), torch.cat([below, second], dim=-1)], dim=-2)
        size *= 2
    return inverse.view(n, C, C)


def _chunk_states(
    new_values: torch.Tensor,
    state_keys: torch.Tensor,
    k_out: torch.Tensor,
    chunk_decay: torch.Tensor,
    state: torch.Tensor | None,
    n_chunks: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The state at the start of every chunk, the new values u, and the state after the last chunk.

    new_values U: (N * BH, C, V); state_keys W: (N * BH, C, K); k_out: (N * BH, C, K), k decayed to the chunk
    end; chunk_decay: (N * BH,), γ_C; state: float32 (BH, K, V) or None (zeros).
    Returns the (N * BH, K, V) start states, u = U - W S_0 (N * BH, C, V) and the (BH, K, V) final state.
    """
    _, C, V = new_values.shape
    K = state_keys.shape[-1]
    U, W = new_values.view(n_chunks, -1, C, V), state_keys.view(n_chunks, -1, C, K)
    k_out_t = k_out.view(n_chunks, -1, C, K).transpose(-1, -2)
    chunk_decay = chunk_decay.view(n_chunks, -1, 1, 1)
    if state is None:
        state = U.new_zeros(U.shape[1], K, V)

    starts, updates = [], []
    # unbind, not indexing: its backward stacks the gradients once instead of a full-size zero tensor per chunk
    for U_i, W_i, k_out_t_i, decay_i in zip(U.unbind(), W.unbind(), k_out_t.unbind(), chunk_decay.unbind()):
        starts.append(state)  # only this loop is sequential
        u = torch.baddbmm(U_i, W_i, state, alpha=-1)  # U - W S_0
        updates.append(u)
        state = torch.baddbmm(state * decay_i, k_out_t_i, u)  # γ_C S_0 + Σ_s (k_s γ_C / γ_s) u_sᵀ
    return torch.cat(starts), torch.cat(updates), state


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    in_place: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token gated delta rule (decoding, where T is usually 1).

    Args:
        q, k: (B, T, H, K) queries and keys, L2-normalised over K by the caller.
        v: (B, T, H, V) values.
        g: (B, T, H) log decay (<= 0) of the state at each step.
        beta: (B, T, H) write strength, in [0, 1], or [0, 2) with negative eigenvalues allowed.
        scale: query scale; defaults to K ** -0.5.
        initial_state: (B, H, K, V) state before the first token, any float dtype (used as float32).
        output_final_state: also return the state after the last token.
        in_place: update ``initial_state`` itself, when it is float32, and return it as the final state (a static
            cache's state, whose address must not change); the same values as a new state.

    Returns:
        o: (B, T, H, V) in v.dtype, and the final state (B, H, K, V) in float32, or None.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    out_dtype = v.dtype
    scale = K**-0.5 if scale is None else scale
    # (B, T, H, D) -> (B, H, T, D), float32
    q, k, v = (x.float().transpose(1, 2) for x in (q, k, v))
    q = q * scale
    g, beta = (x.float().transpose(1, 2)[..., None, None] for x in (g, beta))  # (B, H, T, 1, 1)
    decay = g.exp()
    state = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.float()
    in_place = in_place and state is initial_state  # (.float() of a float32 tensor is the tensor itself)

    outputs = []
    for t in range(T):
        k_t = k[:, :, t, None, :]  # (B, H, 1, K)
        state = state.mul_(decay[:, :, t]) if in_place else decay[:, :, t] * state  # (B, H, K, V)
        error = beta[:, :, t] * (v[:, :, t, None, :] - k_t @ state)  # β (v - Sᵀk): (B, H, 1, V)
        update = k_t.transpose(-1, -2) * error  # k (β (v - Sᵀk))ᵀ
        state = state.add_(update) if in_place else state + update
        outputs.append(q[:, :, t, None, :] @ state)  # (B, H, 1, K) @ (B, H, K, V) -> (B, H, 1, V)
    o = torch.cat(outputs, dim=2).transpose(1, 2)  # (B, H, T, V) -> (B, T, H, V)
    return o.to(out_dtype), state if output_final_state else None
