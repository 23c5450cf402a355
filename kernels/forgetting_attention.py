"""Forgetting attention on the resolved backend: our PyTorch op (``forgetting_attention_torch``) or
flash-linear-attention's ``parallel_forgetting_attn``."""

from __future__ import annotations

import torch

from .dispatch import fla_ops, refuse_packing
from .forgetting_attention_torch import forgetting_attention as forgetting_attention_torch
from .forgetting_attention_torch import forgetting_attention_with_weights

FLA_MAX_ATTENTION_HEAD_DIM = 256  # fla's parallel attention holds a whole key head in one block


def forgetting_attention(q, k, v, log_fgate=None, key_valid=None, *, query_valid=None, cu_seqlens=None,
                         backend: str = "torch"):
    """``forgetting_attention_torch.forgetting_attention`` (default scale ``D^-0.5``) on the resolved ``backend``.

    fla's ``parallel_forgetting_attn`` serves a whole-sequence call (``Tq == Tk``, no cache) whose padding, if any, is
    only at the end of each row: pads then come after every real token, so no real query sees them. The outputs at
    pad positions are zero on both paths. Decoding and prefill continuing a cache (keys before the queries, possibly
    with holes from left padding) use the torch op, which on CUDA runs PyTorch's fused SDPA kernels.

    ``query_valid``: which queries are real (see the torch op; a static cache's decoding step gives it, with keys
    past the query's slot).

    ``cu_seqlens``: ``B = 1`` packed sequences, each attending to itself only; fla only, whole sequences (no cached
    keys, no ``key_valid``) with head size at most ``FLA_MAX_ATTENTION_HEAD_DIM``.
    """
    fla = fla_ops(backend, q.device)
    if cu_seqlens is not None and (key_valid is not None or q.shape[1] != k.shape[1]
                                   or q.shape[-1] > FLA_MAX_ATTENTION_HEAD_DIM):
        raise ValueError("forgetting_attention with cu_seqlens takes whole packed sequences (no cached keys, no "
                         f"key_valid) with head size <= {FLA_MAX_ATTENTION_HEAD_DIM}; got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}")
    if fla is None:
        refuse_packing(cu_seqlens, "forgetting_attention")
    if (fla is None or q.shape[1] != k.shape[1] or q.shape[-1] > FLA_MAX_ATTENTION_HEAD_DIM
            or (key_valid is not None and not _is_right_padded(key_valid))):
        return forgetting_attention_torch(q, k, v, log_fgate, key_valid=key_valid, query_valid=query_valid)
    g = None if log_fgate is None else log_fgate.float().contiguous()
    o = fla.parallel_forgetting_attn(q.contiguous(), k.contiguous(), v.contiguous(), g, scale=q.shape[-1] ** -0.5,
                                     cu_seqlens=cu_seqlens)
    query_valid = key_valid if query_valid is None else query_valid  # (Tq == Tk here)
    if query_valid is not None:
        o = o * query_valid[:, :, None, None].to(o.dtype)
    return o.to(q.dtype)


def forgetting_attention_and_weights(q, k, v, log_fgate=None, key_valid=None, layout=None):
    """``(o, weights)``: the attention of :func:`forgetting_attention` with its ``(B, Hq, Tq, Tk)`` weights (in the
    caller's ``layout``), for ``output_attentions=True``. No fused kernel returns the weights (fla's does not either),
    so this is the eager PyTorch op on every backend and device
    (``forgetting_attention_torch.forgetting_attention_with_weights``)."""
    return forgetting_attention_with_weights(q, k, v, log_fgate, key_valid=key_valid, layout=layout)


def _is_right_padded(key_valid: torch.Tensor) -> bool:
    """Every row is real tokens followed only by padding (one device sync)."""
    lengths = key_valid.sum(dim=1, keepdim=True)
    return bool((key_valid == (torch.arange(key_valid.shape[1], device=key_valid.device) < lengths)).all())
