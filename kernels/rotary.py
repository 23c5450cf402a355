"""Selective RoPE's rotary op: the one place that picks how a rotary module's forward runs.

``rotary_embedding(module, x, q, k, state, ...)`` takes the module (``modeling/rotary.py``'s
``SelectiveRotaryEmbedding``, described here by :class:`PhasePath`) and the backend the model resolved
(``dispatch.resolve_backend``), and runs one of four paths:

=====================================  ================================================================================
when                                   what runs
=====================================  ================================================================================
``"torch+c"``, no autograd, a plan     the compiled CPU kernel (``rotary_cpu``): phase path and rotation in one C call,
for the module and inputs it takes     a prefill or a decoding step; made by its CPython entry (``rotary_cpu_entry``)
                                       where it can be built and takes the call, else through ctypes
``"torch+c"``, autograd, a plan, no    the compiled training path (``rotary_cpu_train``): the same C forward, which also
convolution history to start from      keeps its float32 increments, and a C backward, as one autograd Function
one token per row, no autograd         a decoding step: ``rotary_triton``'s fused step on ``"triton"`` (from the input
                                       where the phase path is the default one), else ``rotary_torch``'s
anything else                          on ``"triton"`` with the default phase path (``fusable_phase_weights``): one
                                       fused op from the input, ``rotary_fused_triton`` (increments and rotation in two
                                       launches, and their backward); otherwise the module's phase increments, then the
                                       cumulative phase and the rotation: ``rotary_triton.selective_rotary_triton`` on
                                       ``"triton"`` (packed sequences as they are), else ``rotary_torch``'s
=====================================  ================================================================================

Every path computes the same math in the same precisions (``modeling/rotary.py``'s docstring); the torch paths are
the reference. Packed sequences reach the op only on ``"triton"`` (``takes_packed``): on the other backends the module
hands it one dense row per sequence.
"""

from __future__ import annotations

import functools
from typing import Protocol

import torch
from torch import nn

from .dispatch import triton_rotary, triton_rotary_from_input
from .rotary_cpu import RotaryPlan
from .rotary_cpu import available as cpu_kernel_available
from .rotary_cpu_entry import entry_for
from .rotary_cpu_train import CompiledRotaryTraining
from .rotary_torch import selective_rotary as selective_rotary_torch
from .rotary_torch import selective_rotary_step


class PhasePath(Protocol):
    """What the op reads of a rotary module: its sizes and parameters, and its phase inputs, computed when the chosen
    path needs them (the phase modules are called there, so their hooks and adapters run)."""

    position_embedding: str  # "selective_rope" or "rope" ("nope" never calls the op)
    temperature: torch.Tensor  # (R,) float32
    rotary_pairs: int  # R
    num_key_heads: int  # Hk (every key head's, also under tensor parallelism)
    head_shard: tuple[int, int] | None  # (rank, ranks) under tensor parallelism
    phase_conv: nn.Module | None  # with ``taps(device, channels)`` and ``activation``
    phase_bias: torch.Tensor | None  # (Hk, R)

    def sequence_increment(self, x, lengths, conv_state, cu_seqlens):
        """``c_t`` ``(B, T, Hk, R)`` float32 (0 at pads) and the new convolution history (or ``None``)."""

    def step_increment(self, x, history, valid, in_place):
        """One token per row: ``c_t`` broadcastable to ``(B, Hk, R)`` in ``phase_dtype`` (rounded as a prefill
        rounds it) and the new convolution history; ``valid`` ``(B, 1, 1)`` or ``None``."""

    def decode_phase_inputs(self, x):
        """One token per row: the projection ``(B, Hk, R)`` and gate logits (``None`` without a gate), float64."""

    def fusable_phase_weights(self):
        """``(down, up, gate weight, gate bias)`` where the fused Triton step may compute the phase inputs itself."""

    def cpu_kernel_parameters(self):
        """``(phase modules, RotaryPlan keyword arguments)``; the arguments ``None`` where the C kernel does not know
        a phase module."""


def rotary_embedding(module: PhasePath, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     state: dict[str, torch.Tensor], lengths: torch.Tensor | None = None, *,
                     cu_seqlens: torch.Tensor | None = None, backend: str = "torch", overwrite_state: bool = False,
                     in_place: bool = False) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """``module``'s forward (``SelectiveRotaryEmbedding.forward``, whose arguments these are) on ``backend``
    (``"torch"``, ``"torch+c"`` or ``"triton"``): rotated q and k and the new state ``{"phase", "phase_conv"}``."""
    if backend == "torch+c" and not torch.compiler.is_compiling():
        cached = module.__dict__.get("_cpu_plan")  # the checks and the C call in C, where the entry can take them
        if cached is not None and cached.entry_call is not None:
            result = cached.entry_call(cached.entry_spec, x, q, k, state, lengths, overwrite_state)
            if result is not None:
                return result  # else: the same call through Python below, which decides (rotary_cpu_entry)
    seq_len = x.shape[1]
    inference = not torch.is_grad_enabled()
    if backend == "torch+c" and seq_len > 0:
        if inference:
            compiled = cpu_kernel_call(module, x, q, k, state, lengths, overwrite_state)  # a prefill or a step
        else:
            compiled = cpu_training_call(module, x, q, k, state, lengths)
        if compiled is not None:
            return compiled
    if seq_len == 1 and cu_seqlens is None and inference:  # a decoding step (the steps have no backward)
        step = decode_step_triton if backend == "triton" else decode_step_torch
        return step(module, x, q, k, state, lengths, in_place)
    if backend == "triton" and module.position_embedding == "selective_rope":
        fused = sequence_from_input_triton(module, x, q, k, state, lengths, cu_seqlens)
        if fused is not None:
            return fused
    increment, conv_state = module.sequence_increment(x, lengths, state.get("phase_conv"), cu_seqlens)
    q, k, phase = selective_rotary(q, k, increment, module.temperature, state.get("phase"), cu_seqlens=cu_seqlens,
                                   backend=backend)
    return q, k, rotary_state(phase, conv_state)


def takes_packed(backend: str) -> bool:
    """Whether the op takes packed sequences (``cu_seqlens``) as they are on ``backend``: the Triton kernel does; the
    torch op takes dense right-padded rows."""
    return backend == "triton"


def rotary_state(phase: torch.Tensor, conv_state: torch.Tensor | None) -> dict[str, torch.Tensor]:
    return {"phase": phase} if conv_state is None else {"phase": phase, "phase_conv": conv_state}


def selective_rotary(q, k, increment, temperature, initial_phase=None, *, cu_seqlens=None, backend: str = "torch"):
    """``rotary_torch.selective_rotary`` (same arguments and results) on the resolved ``backend``; packed sequences
    (``cu_seqlens``, Triton only) as in ``rotary_triton.selective_rotary_triton``."""
    if backend == "triton":
        return triton_rotary().selective_rotary_triton(q, k, increment, temperature, initial_phase,
                                                       cu_seqlens=cu_seqlens)
    if cu_seqlens is not None:
        raise ValueError("cu_seqlens needs the Triton rotary kernel; the torch op takes dense right-padded rows")
    return selective_rotary_torch(q, k, increment, temperature, initial_phase)


def kernel_taps(conv: nn.Module, device: torch.device, channels: int) -> torch.Tensor:
    """The convolution's taps as the Triton kernels take them, ``(C, K)`` or ``(C, 1, K)`` alike: a learned
    convolution's ``(C, 1, K)`` weight as it is (``taps``' ``(C, K)`` view is an aten op in every layer and call, and
    in training its backward another), the fixed difference's ``(C, 2)`` taps."""
    return conv.weight if isinstance(conv, nn.Conv1d) else conv.taps(device, channels)


def sequence_from_input_triton(module: PhasePath, x, q, k, state, lengths, cu_seqlens):
    """A sequence (training or a prefill) with the default phase path (``fusable_phase_weights``) as one fused op
    from the input: ``rotary_fused_triton.selective_rotary_from_input_triton`` (the phase increments and the rotation
    in two launches, three with the per-head gate, and their backward). ``None`` where it does not serve the call
    (another phase path, or an empty one): then the module's increments and ``selective_rotary``."""
    weights = module.fusable_phase_weights()
    if weights is None:
        return None
    conv = module.phase_conv
    result = triton_rotary_from_input().selective_rotary_from_input_triton(
        q, k, x, *weights, module.temperature, initial_phase=state.get("phase"),
        conv_state=None if conv is None else state.get("phase_conv"),
        conv_weight=None if conv is None else kernel_taps(conv, x.device, k.shape[2] * module.rotary_pairs),
        conv_activation=None if conv is None else conv.activation, bias=module.phase_bias, lengths=lengths,
        cu_seqlens=cu_seqlens)
    if result is None:
        return None
    q_out, k_out, phase, conv_state = result
    return q_out, k_out, rotary_state(phase, conv_state)


def decode_step_torch(module: PhasePath, x, q, k, state, lengths, in_place=False):
    """One token per row on the torch path: the module's increment for one token, then
    ``rotary_torch.selective_rotary_step``. ``in_place``: the new phase and history are written into ``state``'s
    tensors where they are float64 and contiguous."""
    batch = x.shape[0]
    valid = None if lengths is None else (lengths > 0).view(batch, 1, 1)  # (B, 1, 1): False for a pad token
    increment, conv_state = module.step_increment(x, state.get("phase_conv"), valid, in_place)
    q_out, k_out, phase = selective_rotary_step(q, k, increment, module.temperature, state.get("phase"), in_place)
    return q_out, k_out, rotary_state(phase, conv_state)


def decode_step_triton(module: PhasePath, x, q, k, state, lengths, in_place=False):
    """One token per row with the fused Triton step: what the module's increments followed by ``selective_rotary``
    compute. The default phase path (``fusable_phase_weights``) runs as one launch from this step's input; other phase
    paths compute the phase inputs first (``decode_phase_inputs``); RoPE's are a unit step, with no convolution, bias
    or gate. The convolution's taps (learned, or the fixed difference) are read directly. ``in_place``: the kernel
    writes the new phase and history into ``state``'s."""
    kernels = triton_rotary()
    valid = None if lengths is None else lengths > 0
    if module.position_embedding == "rope":  # (the steps take q, k and x as they are: (B, 1, ...), no view)
        q_out, k_out, phase, _ = kernels.selective_rotary_decode_triton(
            q, k, unit_step(x.device), module.temperature, phase=state.get("phase"), valid=valid, in_place=in_place)
        return q_out, k_out, rotary_state(phase, None)
    conv = module.phase_conv
    step_state = dict(
        phase=state.get("phase"),
        conv_state=None if conv is None else state.get("phase_conv"),
        conv_weight=None if conv is None else kernel_taps(conv, x.device, k.shape[2] * module.rotary_pairs),
        conv_activation=None if conv is None else conv.activation,
        bias=module.phase_bias,
        valid=valid,
        in_place=in_place,
    )
    weights = module.fusable_phase_weights()
    step = None if weights is None else kernels.selective_rotary_decode_from_input_triton(
        q, k, x, *weights, module.temperature, **step_state)
    if step is None:
        projection, gate_logits = module.decode_phase_inputs(x)
        step = kernels.selective_rotary_decode_triton(q, k, projection, module.temperature, gate_logits=gate_logits,
                                                      **step_state)
    q_out, k_out, phase, conv_state = step
    return q_out, k_out, rotary_state(phase, conv_state)


@functools.lru_cache(maxsize=None)
def unit_step(device: torch.device) -> torch.Tensor:
    """RoPE's phase projection for the fused decode step: one float64 1 on ``device``, which the step broadcasts
    (stride 0) to every row, head and frequency (made once per device and never written, so a decoding step
    launches no fill)."""
    return torch.ones((), dtype=torch.float64, device=device)


def cpu_kernel_call(module: PhasePath, x, q, k, state, lengths, overwrite_state=False):
    """The inference forward (a prefill or a decoding step) as one compiled call (``rotary_cpu``: the same math and
    precisions as the torch path), or ``None`` where the torch path must run instead (see ``cpu_plan`` and
    ``RotaryPlan.try_call``). The backend ``"torch+c"`` asks for it (``"auto"`` on the CPU); ``"torch"`` asked for by
    name stays pure PyTorch, the reference (SPEC §5)."""
    if torch.compiler.is_compiling() or torch.jit.is_tracing():  # a tracer would not see the C call's writes
        return None
    plan = cpu_plan(module, (x.shape[-1], q.shape[2], q.shape[3]))
    if plan is None:
        return None
    phase, lengths = _kernel_phase_and_lengths(state, lengths)
    history = state.get("phase_conv")
    if history is not None and (history.dtype != torch.float64 or not history.is_contiguous()):
        history = history.to(torch.float64).contiguous()
    result = plan.try_call(x, q, k, phase, history, lengths, overwrite_state=overwrite_state)
    if result is None:  # inputs the C kernel does not take, or a stale plan: plan again
        if not _dropped_stale(module, plan):
            return None
        return cpu_kernel_call(module, x, q, k, state, lengths, overwrite_state)
    return result[0], result[1], rotary_state(result[2], result[3])


def cpu_training_call(module: PhasePath, x, q, k, state, lengths):
    """A sequence with autograd as the compiled training forward and backward (``rotary_cpu_train``: the inference
    kernel's forward, bit for bit, and a C backward), or ``None`` where the torch path must run instead: what
    ``cpu_kernel_call`` declines, a convolution history to start from (the compiled backward starts each row's
    convolution afresh), or a ``torch.func`` transform (its wrapped tensors have no memory the C code could read)."""
    if torch.compiler.is_compiling() or torch.jit.is_tracing() or torch._C._are_functorch_transforms_active():
        return None
    plan = cpu_plan(module, (x.shape[-1], q.shape[2], q.shape[3]))
    if plan is None or (plan.has_conv and state.get("phase_conv") is not None):
        return None
    phase, lengths = _kernel_phase_and_lengths(state, lengths)
    if not plan.takes(x, q, k, phase, lengths):  # inputs the C kernel does not take, or a stale plan: plan again
        return cpu_training_call(module, x, q, k, state, lengths) if _dropped_stale(module, plan) else None
    q_out, k_out, phase, conv_state = CompiledRotaryTraining.apply(plan, module, lengths, x, q, k, phase,
                                                                   *plan.gradient_order)
    return q_out, k_out, rotary_state(phase, conv_state)


def _kernel_phase_and_lengths(state, lengths):
    """The cached phase as float64 and ``lengths`` as contiguous int64, as the compiled kernel reads them."""
    phase = state.get("phase")
    if phase is not None and phase.dtype != torch.float64:
        phase = phase.to(torch.float64)
    if lengths is not None and (lengths.dtype != torch.int64 or not lengths.is_contiguous()):
        lengths = lengths.to(torch.int64).contiguous()
    return phase, lengths


def _dropped_stale(module: PhasePath, plan: RotaryPlan) -> bool:
    """After the compiled kernel declined a call: drop ``module``'s plan if a parameter's storage was replaced since
    it was made (the caller then plans again) and say so; ``False``: the inputs were what it declined."""
    if plan.current():
        return False
    del module.__dict__["_cpu_plan"]
    return True


def cpu_plan(module: PhasePath, sizes: tuple[int, int, int]) -> RotaryPlan | None:
    """``module``'s compiled-kernel plan for ``sizes`` (hidden size, ``Hq``, ``D``), made on first use and again
    whenever the phase path changed (:class:`CachedPlan`, kept in the module's ``_cpu_plan``); ``None`` where the C
    kernel must not serve this module: it cannot be built here, forward hooks on the phase modules or global ones (they
    must see their module run), a phase module it does not know (e.g. one wrapped by a PEFT adapter), or parameters
    of mixed dtypes."""
    if nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks:
        return None
    if module.head_shard is not None:  # the kernel is planned for every key head
        return None
    cached = module.__dict__.get("_cpu_plan")  # (not through nn.Module.__getattr__: a decoding step counts µs)
    if cached is None or not cached.valid(sizes):
        cached = module._cpu_plan = CachedPlan.make(module, sizes)
    return cached.plan_if_unhooked()


class CachedPlan:
    """A rotary module's compiled-kernel plan (``None``: no C kernel for this structure) and what it was made from: the
    module's and its phase modules' parameters, buffers and children, and the call's sizes. Valid while all of them are
    the same objects (a replaced storage is the plan's own check, ``RotaryPlan.current``); the phase modules' hooks
    are looked at on every call (adding one assigns nothing). It refers to the rotary module's parameter and child
    dicts but not to the module itself: no reference cycle keeps a deleted model's memory alive until the next
    garbage collection.

    It lives in the module's ``__dict__`` but is never copied: ``copy.deepcopy``, pickling and ``torch.save`` of the
    module leave ``None`` in its place, and ``SelectiveRotaryEmbedding._apply`` drops it (a device move or cast
    replaces the storages)."""

    def __init__(self, plan: RotaryPlan | None, owner: nn.Module, modules: list[nn.Module], sizes: tuple):
        self.plan, self.modules, self.sizes = plan, tuple(modules), sizes
        containers = [c for module in (owner, *modules) for c in (module._parameters, module._buffers, module._modules)]
        self.bindings = tuple((container, key, item) for container in containers for key, item in container.items())
        # An entry added later matters where a forward reads more than the bound entries: the rotary module's own
        # (an absent gate, bias or convolution is a plain None attribute, in neither dict, until one is set) and a
        # Sequential's children (it runs every child it has). The phase modules read only their bound entries.
        counted = [owner] + [module for module in modules if type(module) is nn.Sequential]
        self.counts = tuple((c, len(c)) for module in counted
                            for c in (module._parameters, module._buffers, module._modules))
        # The same checks and the kernel's call as one C function, where Python's headers allow (rotary_cpu_entry)
        entry = None if plan is None else entry_for(plan, self.bindings, self.counts, self.modules)
        self.entry_call, self.entry_spec = entry or (None, None)

    @classmethod
    def make(cls, module: PhasePath, sizes: tuple[int, int, int]) -> CachedPlan:
        """The plan for ``module`` as it is now (``None`` inside where the C kernel cannot serve it)."""
        modules, parameters = module.cpu_kernel_parameters()
        plan = None
        if parameters is not None and cpu_kernel_available():
            hidden_size, num_query_heads, head_dim = sizes
            try:
                plan = RotaryPlan(num_query_heads, module.num_key_heads, head_dim, hidden_size, module.temperature,
                                  **parameters)
            except ValueError:  # e.g. one module cast to another dtype: the torch path handles any mix
                plan = None
        return cls(plan, module, modules, sizes)

    # Both checks run per layer and decoding step, where each costs microseconds (issue 21): plain loops, since
    # any()/all() over generators cost more than the checks themselves here.
    def valid(self, sizes: tuple) -> bool:
        if sizes != self.sizes:
            return False
        for container, key, item in self.bindings:
            if container.get(key) is not item:
                return False
        for container, count in self.counts:
            if len(container) != count:
                return False
        return True

    def plan_if_unhooked(self) -> RotaryPlan | None:
        for module in self.modules:
            if module._forward_hooks or module._forward_pre_hooks:
                return None
        return self.plan

    def __reduce__(self):
        return type(None), ()  # a copy or pickle of the module holds no plan

