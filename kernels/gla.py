"""Gated linear attention on the resolved backend: our PyTorch op (``gla_torch``) or flash-linear-attention's."""

from __future__ import annotations

from .dispatch import fla_ops, float32_state, refuse_packing, repeat_heads
from .gla_torch import chunk_gla, recurrent_gla


def gated_linear_attention(q, k, v, gk, *, initial_state=None, output_final_state=False, cu_seqlens=None,
                           in_place=False, backend: str = "torch"):
    """Gated linear attention, ``S_t = diag(exp(gk_t)) S_{t-1} + k_t v_tᵀ``, ``o_t = S_tᵀ q_t · K^-0.5``.

    ``q``: ``(B, T, H, K)``; ``k, gk``: ``(B, T, Hk, K)`` (gk log-space per key channel, float32); ``v``:
    ``(B, T, Hk, V)``, with ``H % Hk == 0`` (GQA: key/value head ``j`` serves query heads ``j·G .. j·G + G - 1``); the
    state ``(B, H, K, V)`` float32. Returns ``(o (B, T, H, V) in q.dtype, final state or None)``. A single token takes
    the recurrent form (decoding), longer inputs the chunked one. ``cu_seqlens`` (fla only): ``B = 1`` packed
    sequences, states ``(N, H, K, V)``. ``in_place``: a single token's recurrent torch step writes the final state into
    ``initial_state`` (a static cache's); fla's kernels and the chunked form leave a new one.
    """
    k, v, gk = repeat_heads(q.shape[2] // k.shape[2], k, v, gk)  # both implementations take one key per query head
    fla = fla_ops(backend, q.device)
    if fla is None:
        refuse_packing(cu_seqlens, "gated_linear_attention")
        if q.shape[1] == 1:
            return recurrent_gla(q, k, v, gk, initial_state=initial_state, output_final_state=output_final_state,
                                 in_place=in_place)
        return chunk_gla(q, k, v, gk, initial_state=initial_state, output_final_state=output_final_state)
    op = fla.fused_recurrent_gla if q.shape[1] == 1 else fla.chunk_gla  # both have a backward
    o, state = op(q.contiguous(), k.contiguous(), v.contiguous(), gk.contiguous(), scale=q.shape[-1] ** -0.5,
                  initial_state=float32_state(initial_state), output_final_state=output_final_state,
                  cu_seqlens=cu_seqlens)
    return o.to(q.dtype), state
