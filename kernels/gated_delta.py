"""The gated delta rule on the resolved backend: our PyTorch op (``gated_delta_torch``) or flash-linear-attention's."""

from __future__ import annotations

import torch

from .dispatch import fla_ops, fla_refuses_gated_delta_backward, float32_state, refuse_packing, repeat_heads, warn_once
from .gated_delta_torch import chunk_gated_delta_rule, recurrent_gated_delta_rule


def gated_delta_rule(q, k, v, g, beta, *, initial_state=None, output_final_state=False, cu_seqlens=None,
                     in_place=False, backend: str = "torch"):
    """The gated delta rule with grouped value heads.

    ``q, k``: ``(B, T, H, K)`` L2-normalised; ``v``: ``(B, T, HV, V)`` with ``HV % H == 0`` (value head ``j`` reads
    key head ``j // (HV / H)``); ``g`` (log decay) and ``beta``: ``(B, T, HV)`` float32; the state ``(B, HV, K, V)``
    float32. Returns ``(o (B, T, HV, V) in v.dtype, final state or None)``. ``cu_seqlens`` (fla only): ``B = 1``
    packed sequences, states ``(N, HV, K, V)``. ``in_place``: a single token's recurrent torch step writes the final
    state into ``initial_state`` (a static cache's); fla's kernels and the chunked form leave a new one.
    """
    fla = fla_ops(backend, q.device)
    needs_grad = _needs_grad(q, k, v, g, beta, initial_state)
    if fla is not None and needs_grad and fla_refuses_gated_delta_backward():
        if cu_seqlens is not None:
            raise ValueError("gated_delta_rule: training on packed sequences needs fla's backward, which fla refuses "
                             "on this GPU with this Triton (fla issue #640: Hopper with Triton < 3.7.1); upgrade "
                             "Triton to >= 3.7.1 or pip install tilelang, or train on padded rows")
        warn_once("selective-rope: fla refuses the gated delta rule's backward on Hopper GPUs with Triton < 3.7.1 "
                  "(fla issue #640), so Gated DeltaNet trains with our PyTorch op here; upgrade Triton to >= 3.7.1 "
                  "or pip install tilelang for fla's kernels")
        fla = None
    if fla is None:
        refuse_packing(cu_seqlens, "gated_delta_rule")
        q, k = repeat_heads(v.shape[2] // q.shape[2], q, k)  # our torch ops take one key per value head
        if q.shape[1] == 1:
            return recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=initial_state,
                                              output_final_state=output_final_state, in_place=in_place)
        return chunk_gated_delta_rule(q, k, v, g, beta, initial_state=initial_state,
                                      output_final_state=output_final_state)
    # fla's recurrent kernel has no backward (NotImplementedError in fla 0.6.0): a single token that needs gradients
    # (training on one-token calls) takes the chunked kernel, which is exact at T = 1 too.
    recurrent = q.shape[1] == 1 and not needs_grad
    op = fla.fused_recurrent_gated_delta_rule if recurrent else fla.chunk_gated_delta_rule
    # fla groups value heads itself (same head mapping); q and k are normalised already, β is post-sigmoid. Its
    # kernels multiply q, k and v in one dtype: under autocast or with bf16 weights the rotated q and k arrive in
    # float32 (the Selective RoPE module stays float32) beside a bf16 v, which Triton refuses to compile.
    q, k = q.to(v.dtype), k.to(v.dtype)
    o, state = op(q.contiguous(), k.contiguous(), v.contiguous(), g=g.contiguous(), beta=beta.contiguous(),
                  scale=k.shape[-1] ** -0.5, initial_state=float32_state(initial_state),
                  output_final_state=output_final_state, use_qk_l2norm_in_kernel=False, cu_seqlens=cu_seqlens)
    return o.to(v.dtype), state


def _needs_grad(*tensors: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
