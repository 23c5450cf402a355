"""Which implementation runs the ops: our PyTorch ops, our Triton kernels, or flash-linear-attention's (fla).

This module only decides; each op lives in its own module behind it (``rotary``, ``gla``, ``gated_delta``,
``forgetting_attention``), so a model imports, and a saved model carries, only the ops of its own family. The model
resolves the backend once per call (``resolve_backend``) and hands it to every op, which asks ``fla_ops`` once.

The request comes from the environment variable ``SELECTIVE_ROPE_BACKEND`` if it is set (so an operator can switch a
deployed model without touching its config), else from the config's ``backend`` field:

- ``"auto"`` (default): on CUDA, our Triton Selective RoPE kernels and fla's mixer kernels; elsewhere PyTorch, with
  the rotary module compiled on the CPU, for inference and training (``rotary_cpu``, ``rotary_cpu_train``; resolved as
  ``"torch+c"``, unless
  ``SELECTIVE_ROPE_CPU_KERNEL=0``, or under ``torch.compile``, which cannot trace the C call: ``"torch"`` there).
- ``"torch"``: PyTorch everywhere (the reference; the rotary module too).
- ``"triton"``: as ``auto`` on CUDA. On CPU, our Triton rotary kernels run only under ``TRITON_INTERPRET=1`` (how the
  tests compare the Triton path with the torch one on a machine without GPU); the mixers stay PyTorch: fla is only
  ever called for CUDA tensors (``fla_ops``; the tests replace it to run fla's kernels under the interpreter too).

A missing ``triton`` or ``flash-linear-attention`` on CUDA (an ``ImportError``) falls back to PyTorch with one
warning, never an error. triton and fla are imported lazily, and fla only for CUDA tensors: ``import fla`` registers
its own models with transformers' Auto classes.

Every op tensor is in flash-linear-attention's layout, ``[B, T, H, D]`` (our torch ops use it too). The op modules
keep our ops' conventions: the default query scale ``D^-0.5``, log-space decays, float32 recurrent states
``[B, H, K, V]``. Packed sequences (``cu_seqlens``, ``B = 1``) go to fla's and our Triton kernels as they are
(``keeps_packed``); the torch ops take dense right-padded rows instead.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
import warnings
from types import SimpleNamespace

import torch

from .backends import BACKENDS, ENV_VAR, interpreting
from .rotary_cpu import enabled as cpu_kernel_enabled

# The devices fla's kernels run on. Only CUDA: tests add "cpu" to run them under Triton's interpreter.
FLA_DEVICES = ("cuda",)

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


def resolve_backend(config_value: str | None, device: torch.device | str) -> str:
    """``"torch"``, ``"torch+c"`` or ``"triton"`` (``backends.RESOLVED``): who runs our own ops (Selective RoPE) for
    tensors on ``device``. ``"torch+c"`` is PyTorch with the rotary module's calls (inference, and training with its C
    backward) compiled (``rotary_cpu``): on the CPU, unless ``"torch"`` was asked for by name or
    ``SELECTIVE_ROPE_CPU_KERNEL=0``. Both environment variables are read here, once per model call.

    The mixers use fla's kernels only where this says ``"triton"`` *and* the tensors are on CUDA (see ``fla_ops``);
    every other value runs their PyTorch ops.
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
    # Under torch.compile, PyTorch: the C kernel is called through ctypes / a CPython entry, which a tracer cannot see.
    compiled_kernel = device_type == "cpu" and cpu_kernel_enabled() and not torch.compiler.is_compiling()
    return "torch+c" if compiled_kernel else "torch"


# Imports tried once per process: {"triton": module or None, "triton_from_input": module or None, "fla": namespace
# or None}. A plain dict rather than functools.lru_cache, which torch.compile warns about.
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


def triton_rotary_from_input():
    """Our fused Triton rotary op from the layer input (``rotary_fused_triton``), or ``None`` without triton."""
    if "triton_from_input" not in _imported:
        try:
            from .rotary_fused_triton import selective_rotary_from_input_triton
        except ImportError:
            _imported["triton_from_input"] = None
        else:
            _imported["triton_from_input"] = sys.modules[selective_rotary_from_input_triton.__module__]
    return _imported["triton_from_input"]


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

    The one place that decides whether fla runs, asked once per op call.
    """
    if backend != "triton" or torch.device(device).type not in FLA_DEVICES:
        return None
    ops = _import_fla()
    if ops is None:
        warn_once("selective-rope: flash-linear-attention cannot be imported, so the GLA / Gated DeltaNet / FoX "
                  "mixers run in PyTorch on CUDA (pip install flash-linear-attention for its kernels)")
    return ops


def fla_refuses_gated_delta_backward() -> bool:
    """Whether fla's gated delta rule refuses its backward here: fla 0.6 raises in it on Hopper GPUs with Triton in
    [3.4, 3.7.1) unless tilelang takes the kernel, because that Triton computes wrong gradients there (fla issue
    #640). Found on an H200 with torch 2.11's Triton 3.6 (benchmarks/results/gpu/2026-11-28-h200)."""
    try:
        from fla.utils import IS_NVIDIA_HOPPER, TRITON_ABOVE_3_4_0, TRITON_ABOVE_3_7_1
    except ImportError:  # an fla without the check
        return False
    return IS_NVIDIA_HOPPER and TRITON_ABOVE_3_4_0 and not TRITON_ABOVE_3_7_1 and not _tilelang_installed()


@functools.cache
def _tilelang_installed() -> bool:
    """Looked up once: the question is asked on every training call of the gated delta rule on CUDA."""
    return importlib.util.find_spec("tilelang") is not None


def keeps_packed(backend: str, device: torch.device | str) -> bool:
    """Whether packed sequences (``cu_seqlens``) reach the mixers as they are, ``(1, total, ...)``, on the resolved
    ``backend`` (``resolve_backend``).

    fla's kernels and our Triton rotary kernel take ``cu_seqlens`` natively, so on the Triton path a packed batch
    pays for no padding; the torch ops take dense right-padded rows (one per sequence) instead.
    """
    return fla_ops(backend, torch.device(device)) is not None


def refuse_packing(cu_seqlens, op: str) -> None:
    """For the torch ops, which take dense right-padded rows: callers pass ``cu_seqlens`` only where ``keeps_packed``
    said so."""
    if cu_seqlens is not None:
        raise ValueError(f"{op}: cu_seqlens needs flash-linear-attention's kernels, which do not run here; the torch "
                         "ops take dense right-padded rows")


def float32_state(state: torch.Tensor | None) -> torch.Tensor | None:
    """A recurrent state as fla's kernels take it."""
    return None if state is None else state.float().contiguous()


def repeat_heads(groups: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Grouped heads (GQA) for the ops that take one key head per query (or value) head: each tensor
    ``(B, T, H, ...)`` -> ``(B, T, H·groups, ...)``, head ``h`` serving the ``groups`` consecutive heads
    ``h·groups .. h·groups + groups - 1`` (transformers' and flash-linear-attention's grouping)."""
    if groups == 1:
        return tensors
    return tuple(t.repeat_interleave(groups, dim=2) for t in tensors)
