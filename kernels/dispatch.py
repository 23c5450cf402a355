"""Which implementation runs each op: our PyTorch ops, our Triton kernels, or flash-linear-attention's.

The request comes from the environment variable ``SELECTIVE_ROPE_BACKEND`` if it is set (so an operator can switch a
deployed model without touching its config), else from the config's ``backend`` field:

- ``"auto"`` (default): on CUDA, our Triton Selective RoPE kernels and fla's mixer kernels; elsewhere PyTorch.
- ``"torch"``: PyTorch everywhere (the reference).
- ``"triton"``: as ``auto`` on CUDA. On CPU, our Triton rotary kernels run only under ``TRITON_INTERPRET=1`` (how the
  tests compare the Triton path with the torch one on a machine without GPU); the mixers stay PyTorch: fla is only
  ever called for CUDA tensors (``fla_ops``; the tests replace it to run fla's kernels under the interpreter too).

A missing ``triton`` or ``flash-linear-attention`` on CUDA (an ``ImportError``) falls back to PyTorch with one
warning, never an error. triton and fla are imported lazily, and fla only for CUDA tensors: ``import fla`` registers
its own models with transformers' Auto classes.

Every tensor here is in flash-linear-attention's layout, ``[B, T, H, D]`` (our torch ops use it too). The wrappers
keep our ops' conventions: the default query scale ``D^-0.5``, log-space decays, float32 recurrent states
``[B, H, K, V]``. Packed sequences (``cu_seqlens``, ``B = 1``) go to fla's and our Triton kernels as they are
(``keeps_packed``); the torch ops take dense right-padded rows instead.
"""

from __future__ import annotations

import os
import sys
import warnings
from types import SimpleNamespace

import torch

from .forgetting_attention_torch import forgetting_attention as forgetting_attention_torch
from .gated_delta_torch import chunk_gated_delta_rule, recurrent_gated_delta_rule
from .gla_torch import chunk_gla, recurrent_gla
from .rotary_torch import selective_rotary as selective_rotary_torch

BACKENDS = ("auto", "torch", "triton")
ENV_VAR = "SELECTIVE_ROPE_BACKEND"
FLA_MAX_ATTENTION_HEAD_DIM = 256  # fla's parallel attention holds a whole key head in one block

_warned: set[str] = set()


def warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def requested_backend(config_value: str | None = None) -> str:
    """``SELECTIVE_ROPE_BACKEND`` if set (non-empty), else ``config_value`` (``None`` means ``"auto"``), validated."""
    from_env = os.environ.get(ENV_VAR, "").strip().lower()
    if from_env:
        if from_env not in BACKENDS:
            raise ValueError(f"`{ENV_VAR}`={os.environ[ENV_VAR]!r} is invalid: expected one of {list(BACKENDS)}.")
        return from_env
    value = "auto" if config_value is None else config_value
    if value not in BACKENDS:
        raise ValueError(f"`backend`={value!r} is invalid: expected one of {list(BACKENDS)}.")
    return value


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def resolve_backend(config_value: str | None, device: torch.device | str) -> str:
    """``"torch"`` or ``"triton"``: who runs our own ops (Selective RoPE) for tensors on ``device``.

    The mixers use fla's kernels only where this says ``"triton"`` *and* the tensors are on CUDA (see ``fla_ops``).
    """
    requested = requested_backend(config_value)
    if requested == "torch":
        return "torch"
    device_type = torch.device(device).type
    if device_type == "cuda":
        if triton_rotary() is not None:
            return "triton"
        warn_once("selective-rope: triton cannot be imported, so the Selective RoPE kernels run in PyTorch on CUDA "
                  "(pip install triton for the fused kernels)")
        return "torch"
    if requested == "triton":
        if interpreting() and triton_rotary() is not None:
            return "triton"
        warn_once(f"selective-rope: backend 'triton' was requested for tensors on {device_type}, where the Triton "
                  "kernels only run under TRITON_INTERPRET=1 (with triton installed); using PyTorch")
    return "torch"


# Imports tried once per process: {"triton": module or None, "fla": namespace or None}. A plain dict rather than
# functools.lru_cache, which torch.compile warns about.
_imported: dict[str, object] = {}


def triton_rotary():
    """Our Triton rotary module, or ``None`` when triton cannot be imported."""
    if "triton" not in _imported:
        # `from .module import name`: the relative form transformers follows when it copies a saved model's code
        # (trust_remote_code), so the Triton kernels travel with the model.
        try:
            from .rotary_triton import selective_rotary_triton
        except ImportError:
            _imported["triton"] = None
        else:  # the module itself: its functions are looked up at each call
            _imported["triton"] = sys.modules[selective_rotary_triton.__module__]
    return _imported["triton"]


def _import_fla() -> SimpleNamespace | None:
    if "fla" not in _imported:
        try:
            from fla.ops.forgetting_attn import parallel_forgetting_attn
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
            from fla.ops.gla import chunk_gla, fused_recurrent_gla
        except ImportError:
            _imported["fla"] = None
        else:
            _imported["fla"] = SimpleNamespace(
                chunk_gla=chunk_gla, fused_recurrent_gla=fused_recurrent_gla,
                chunk_gated_delta_rule=chunk_gated_delta_rule,
                fused_recurrent_gated_delta_rule=fused_recurrent_gated_delta_rule,
                parallel_forgetting_attn=parallel_forgetting_attn)
    return _imported["fla"]


def fla_ops(backend: str, device: torch.device) -> SimpleNamespace | None:
    """fla's kernels when ``backend`` (from ``resolve_backend``) is ``"triton"`` and ``device`` is CUDA; else None.

    The one place that decides whether fla runs (the tests replace it to run fla under Triton's interpreter on CPU).
    """
    if backend != "triton" or torch.device(device).type != "cuda":
        return None
    ops = _import_fla()
    if ops is None:
        warn_once("selective-rope: flash-linear-attention cannot be imported, so the GLA / Gated DeltaNet / FoX "
                  "mixers run in PyTorch on CUDA (pip install flash-linear-attention for its kernels)")
    return ops


def keeps_packed(backend: str, device: torch.device | str) -> bool:
    """Whether packed sequences (``cu_seqlens``) reach the mixers as they are, ``(1, total, ...)``, on the resolved
    ``backend`` (``resolve_backend``).

    fla's kernels and our Triton rotary kernel take ``cu_seqlens`` natively, so on the Triton path a packed batch
    pays for no padding; the torch ops take dense right-padded rows (one per sequence) instead.
    """
    return fla_ops(backend, torch.device(device)) is not None


def _no_packing(cu_seqlens, op: str) -> None:
    if cu_seqlens is not None:  # callers pass cu_seqlens only where `keeps_packed` said so
        raise ValueError(f"{op}: cu_seqlens needs flash-linear-attention's kernels, which do not run here; the torch "
                         "ops take dense right-padded rows")


# --------------------------------------------------------------------------------------------------------------------
# Selective RoPE
# --------------------------------------------------------------------------------------------------------------------
def selective_rotary(q, k, increment, temperature, initial_phase=None, *, cu_seqlens=None, backend: str = "torch"):
    """``rotary_torch.selective_rotary`` (same arguments and results) on the resolved ``backend``; packed sequences
    (``cu_seqlens``, Triton only) as in ``rotary_triton.selective_rotary_triton``."""
    if backend == "triton":
        return triton_rotary().selective_rotary_triton(q, k, increment, temperature, initial_phase,
                                                       cu_seqlens=cu_seqlens)
    if cu_seqlens is not None:
        raise ValueError("cu_seqlens needs the Triton rotary kernel; the torch op takes dense right-padded rows")
    return selective_rotary_torch(q, k, increment, temperature, initial_phase)


def selective_rotary_decode(*args, **kwargs):
    """The fused single-token step (Triton only): see ``rotary_triton.selective_rotary_decode_triton``."""
    return triton_rotary().selective_rotary_decode_triton(*args, **kwargs)


# --------------------------------------------------------------------------------------------------------------------
# mixers
# --------------------------------------------------------------------------------------------------------------------
def gated_linear_attention(q, k, v, gk, *, initial_state=None, output_final_state=False, cu_seqlens=None,
                           backend: str = "torch"):
    """Gated linear attention, ``S_t = diag(exp(gk_t)) S_{t-1} + k_t v_tᵀ``, ``o_t = S_tᵀ q_t · K^-0.5``.

    ``q, k, gk``: ``(B, T, H, K)`` (gk log-space per key channel, float32); ``v``: ``(B, T, H, V)``; the state
    ``(B, H, K, V)`` float32. Returns ``(o in q.dtype, final state or None)``. A single token takes the recurrent
    form (decoding), longer inputs the chunked one. ``cu_seqlens`` (fla only): ``B = 1`` packed sequences, states
    ``(N, H, K, V)``.
    """
    fla = fla_ops(backend, q.device)
    if fla is None:
        _no_packing(cu_seqlens, "gated_linear_attention")
        op = recurrent_gla if q.shape[1] == 1 else chunk_gla
        return op(q, k, v, gk, initial_state=initial_state, output_final_state=output_final_state)
    op = fla.fused_recurrent_gla if q.shape[1] == 1 else fla.chunk_gla  # both have a backward
    o, state = op(q.contiguous(), k.contiguous(), v.contiguous(), gk.contiguous(), scale=q.shape[-1] ** -0.5,
                  initial_state=_float32(initial_state), output_final_state=output_final_state, cu_seqlens=cu_seqlens)
    return o.to(q.dtype), state


def gated_delta_rule(q, k, v, g, beta, *, initial_state=None, output_final_state=False, cu_seqlens=None,
                     backend: str = "torch"):
    """The gated delta rule with grouped value heads.

    ``q, k``: ``(B, T, H, K)`` L2-normalised; ``v``: ``(B, T, HV, V)`` with ``HV % H == 0`` (value head ``j`` reads
    key head ``j // (HV / H)``); ``g`` (log decay) and ``beta``: ``(B, T, HV)`` float32; the state ``(B, HV, K, V)``
    float32. Returns ``(o (B, T, HV, V) in v.dtype, final state or None)``. ``cu_seqlens`` (fla only): ``B = 1``
    packed sequences, states ``(N, HV, K, V)``.
    """
    fla = fla_ops(backend, q.device)
    if fla is None:
        _no_packing(cu_seqlens, "gated_delta_rule")
        groups = v.shape[2] // q.shape[2]
        if groups > 1:  # our torch ops take one key per value head
            q, k = q.repeat_interleave(groups, dim=2), k.repeat_interleave(groups, dim=2)
        op = recurrent_gated_delta_rule if q.shape[1] == 1 else chunk_gated_delta_rule
        return op(q, k, v, g, beta, initial_state=initial_state, output_final_state=output_final_state)
    # fla's recurrent kernel has no backward (NotImplementedError in fla 0.6.0): a single token that needs gradients
    # (training on one-token calls) takes the chunked kernel, which is exact at T = 1 too.
    recurrent = q.shape[1] == 1 and not _needs_grad(q, k, v, g, beta, initial_state)
    op = fla.fused_recurrent_gated_delta_rule if recurrent else fla.chunk_gated_delta_rule
    # fla groups value heads itself (same head mapping); q and k are normalised already, β is post-sigmoid.
    o, state = op(q.contiguous(), k.contiguous(), v.contiguous(), g=g.contiguous(), beta=beta.contiguous(),
                  scale=k.shape[-1] ** -0.5, initial_state=_float32(initial_state),
                  output_final_state=output_final_state, use_qk_l2norm_in_kernel=False, cu_seqlens=cu_seqlens)
    return o.to(v.dtype), state


def forgetting_attention(q, k, v, log_fgate=None, key_valid=None, *, cu_seqlens=None, backend: str = "torch"):
    """``forgetting_attention_torch.forgetting_attention`` (default scale ``D^-0.5``) on the resolved ``backend``.

    fla's ``parallel_forgetting_attn`` serves a whole-sequence call (``Tq == Tk``, no cache) whose padding, if any, is
    only at the end of each row: pads then come after every real token, so no real query sees them. The outputs at
    pad positions are zero on both paths. Decoding and prefill continuing a cache (keys before the queries, possibly
    with holes from left padding) use the torch op, which on CUDA runs PyTorch's fused SDPA kernels.

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
        _no_packing(cu_seqlens, "forgetting_attention")
    if (fla is None or q.shape[1] != k.shape[1] or q.shape[-1] > FLA_MAX_ATTENTION_HEAD_DIM
            or (key_valid is not None and not _is_right_padded(key_valid))):
        return forgetting_attention_torch(q, k, v, log_fgate, key_valid=key_valid)
    g = None if log_fgate is None else log_fgate.float().contiguous()
    o = fla.parallel_forgetting_attn(q.contiguous(), k.contiguous(), v.contiguous(), g, scale=q.shape[-1] ** -0.5,
                                     cu_seqlens=cu_seqlens)
    if key_valid is not None:
        o = o * key_valid[:, :, None, None].to(o.dtype)
    return o.to(q.dtype)


def _is_right_padded(key_valid: torch.Tensor) -> bool:
    """Every row is real tokens followed only by padding (one device sync)."""
    lengths = key_valid.sum(dim=1, keepdim=True)
    return bool((key_valid == (torch.arange(key_valid.shape[1], device=key_valid.device) < lengths)).all())


def _needs_grad(*tensors: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _float32(state: torch.Tensor | None) -> torch.Tensor | None:
    return None if state is None else state.float().contiguous()
