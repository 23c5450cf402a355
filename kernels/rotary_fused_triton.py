"""Selective RoPE from the layer's input on Triton, for the default phase path (issue 46): the phase increments and
the rotation in a few launches (two each way, and one for the per-head gates), forward and backward through one op.

``selective_rotary_from_input_triton`` computes what ``SelectiveRotaryEmbedding.phase_increment`` followed by
``rotary_triton.selective_rotary_triton`` compute, for a ``"low_rank"`` projection, the per-head gate or none, a
causal convolution or none and the optional bias (``SelectiveRotaryEmbedding.fusable_phase_weights``):

- forward: with the per-head gate, ``phase_triton._gate_kernel`` computes every head's gate once per token; then
  ``phase_triton._phase_increment_kernel`` writes the float32 increments and, as the rotary scan's pass 1, every time
  chunk's total (float64, after the initial phase); ``rotary_triton._selective_rotary_fwd_kernel`` sums the totals
  before its chunk itself and rotates q and k. Two launches (three with the gate); the only torch ops are the
  outputs' and the gates' allocations.
- backward: the rotary backward's two walks (from the saved chunk totals: no pass 1 again) give ``dq``, ``dk``,
  ``d(increment)``, ``d(temperature)`` and ``d(initial phase)``; then ``phase_triton.phase_increment_backward_triton``
  recomputes the phase path from the input and gives the gradients of the input and of the phase weights.

Saved for the backward: q, k, x, the weights, the float32 increments and the chunk totals (``(N * Hk, chunks + 1,
R)`` float64: a few values per chunk of hundreds of tokens); none of the phase path's float64 intermediates, which
the unfused path keeps (~357 MiB per layer for a 370M FoX at 8 x 2048 tokens, issue 46). The cached convolution
history (``conv_state``) gets no gradient, and the new history is not differentiable (a cache's).

Plain eager calls run the functions through ``_EagerFused`` (``rotary_triton._EagerRotary``'s reasons: no dispatch
layers); traced, compiled, subclassed and functorch calls see two custom ops, ``selective_rope::rotary_from_input``
(with fake shapes and a registered autograd formula) and ``selective_rope::rotary_from_input_backward``.
"""

from __future__ import annotations

import torch

from .phase_triton import WalkSums, _check_phase_inputs, _dense, _increment_backward, _launch
from .rotary_triton import _as, _backward_walks, _check_shapes, _forward_walk, _num_seqs, _plain_eager_call, _plan

__all__ = ["selective_rotary_from_input_triton"]

# The phase weights whose gradients the backward returns, in its order (``phase_increment_backward_triton``'s).
_PHASE_INPUTS = ("x", "down", "up", "conv_weight", "bias", "gate_weight", "gate_bias")


def _forward_impl(
    q: torch.Tensor,
    k: torch.Tensor,
    x: torch.Tensor,
    down: torch.Tensor,
    up: torch.Tensor,
    conv_weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    gate_weight: torch.Tensor | None,
    gate_bias: torch.Tensor | None,
    temperature: torch.Tensor,
    initial_phase: torch.Tensor | None,
    conv_state: torch.Tensor | None,
    lengths: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    silu: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Checked, non-empty inputs (``selective_rotary_from_input_triton``) -> rotated q and k, the final phase
    ``(N, Hk, R)`` float64, the new convolution history ``(N, K-1, Hk * R)`` float64 (``K - 1 == 0`` without a
    convolution), and for the backward the increments ``(B, T, Hk, R)`` float32 and the chunk totals."""
    batch, seq_len = q.shape[:2]
    num_key_heads, rotary_pairs = k.shape[2], temperature.shape[0]
    num_seqs = _num_seqs(q, cu_seqlens)
    conv_k = 0 if conv_weight is None else conv_weight.shape[-1]
    plan = _plan(q, num_seqs, num_key_heads, rotary_pairs)
    rows, _, chunks = plan.grid
    out_q, out_k = torch.empty_like(q), torch.empty_like(k)
    final = q.new_empty(num_seqs, num_key_heads, rotary_pairs, dtype=torch.float64)
    new_conv = q.new_empty(num_seqs, max(conv_k - 1, 0), num_key_heads * rotary_pairs, dtype=torch.float64)
    increment = q.new_empty(batch, seq_len, num_key_heads, rotary_pairs, dtype=torch.float32)
    totals = q.new_empty(rows, chunks + 1, rotary_pairs, dtype=torch.float64)  # slot 0: the initial phase
    _launch(x, down, up, conv_weight, silu, bias, gate_weight, gate_bias, lengths, cu_seqlens, conv_state,
            increment, new_conv if conv_k > 1 else None, plan.chunk, chunks, totals, initial_phase)
    _forward_walk(plan, totals, q, k, increment, temperature, cu_seqlens, out_q, out_k, final)
    return out_q, out_k, final, new_conv, increment, totals


_forward_op = torch.library.custom_op("selective_rope::rotary_from_input", _forward_impl, mutates_args=())


@_forward_op.register_fake
def _(q, k, x, down, up, conv_weight, bias, gate_weight, gate_bias, temperature, initial_phase, conv_state, lengths,
      cu_seqlens, silu):
    num_seqs, num_key_heads, rotary_pairs = _num_seqs(q, cu_seqlens), k.shape[2], temperature.shape[0]
    chunks = _plan(q, num_seqs, num_key_heads, rotary_pairs).grid[2]
    conv_k = 0 if conv_weight is None else conv_weight.shape[-1]
    return (torch.empty_like(q), torch.empty_like(k),
            q.new_empty(num_seqs, num_key_heads, rotary_pairs, dtype=torch.float64),
            q.new_empty(num_seqs, max(conv_k - 1, 0), num_key_heads * rotary_pairs, dtype=torch.float64),
            q.new_empty(*k.shape[:3], rotary_pairs, dtype=torch.float32),
            q.new_empty(num_seqs * num_key_heads, chunks + 1, rotary_pairs, dtype=torch.float64))


def _backward_impl(
    q: torch.Tensor,
    k: torch.Tensor,
    x: torch.Tensor,
    down: torch.Tensor,
    up: torch.Tensor,
    conv_weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    gate_weight: torch.Tensor | None,
    gate_bias: torch.Tensor | None,
    temperature: torch.Tensor,
    conv_state: torch.Tensor | None,
    lengths: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    increment: torch.Tensor,
    totals: torch.Tensor,
    grad_q: torch.Tensor,
    grad_k: torch.Tensor,
    grad_final: torch.Tensor | None,
    silu: bool,
    need_temperature_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Gradients of ``rotary_from_input``: ``(dq, dk, d_temperature (R,) float32, d_initial_phase (N, Hk, R)
    float64, [the gradients of x and of every weight given, in _PHASE_INPUTS' order, each in its dtype]).``"""
    num_key_heads, rotary_pairs = k.shape[2], temperature.shape[0]
    num_seqs = _num_seqs(q, cu_seqlens)
    plan = _plan(q, num_seqs, num_key_heads, rotary_pairs)
    # Every token of a dense row is a chunk's, and written; packed rows may end before T (zeros there).
    make = torch.empty if cu_seqlens is None else torch.zeros
    dinc = make(increment.shape, dtype=torch.float32, device=q.device)
    dfinal = None if grad_final is None else _as(grad_final, torch.float32).view(-1, rotary_pairs)
    dq, dk, walk_sums, dinit = _backward_walks(plan, totals, q, k, grad_q, grad_k, dfinal, increment, temperature,
                                               cu_seqlens, need_temperature_grad, dinc, fused=True)
    # The phase backward adds the later chunks' sums to each token's d(increment) (each chunk was walked back alone),
    # writes d(initial phase) with several chunks, and sums d(temperature): no launch and no op between the two.
    dtemp = q.new_empty(rotary_pairs, dtype=torch.float32)
    conv_k = 0 if conv_weight is None else conv_weight.shape[-1]
    grads = _increment_backward(dinc, x, down, up, conv_weight, silu, bias, gate_weight, gate_bias, lengths,
                                cu_seqlens, conv_state, num_seqs, conv_k,
                                WalkSums(walk_sums, plan.chunk, plan.grid[2], dinit, dtemp))
    inputs = (x, down, up, conv_weight, bias, gate_weight, gate_bias)
    phase_grads = [torch.zeros_like(given) if grad is None else grad
                   for given, grad in zip(inputs, grads) if given is not None]
    return dq, dk, dtemp, dinit, phase_grads


_backward_op = torch.library.custom_op("selective_rope::rotary_from_input_backward", _backward_impl, mutates_args=())


@_backward_op.register_fake
def _(q, k, x, down, up, conv_weight, bias, gate_weight, gate_bias, temperature, conv_state, lengths, cu_seqlens,
      increment, totals, grad_q, grad_k, grad_final, silu, need_temperature_grad):
    num_key_heads, rotary_pairs = k.shape[2], temperature.shape[0]
    dinit = q.new_empty(_num_seqs(q, cu_seqlens), num_key_heads, rotary_pairs, dtype=torch.float64)
    inputs = (x, down, up, conv_weight, bias, gate_weight, gate_bias)
    return (torch.empty_like(q), torch.empty_like(k), q.new_empty(rotary_pairs, dtype=torch.float32), dinit,
            [torch.empty_like(given) for given in inputs if given is not None])


def _setup_context(ctx, inputs, output) -> None:
    (q, k, x, down, up, conv_weight, bias, gate_weight, gate_bias, temperature, initial_phase, conv_state, lengths,
     cu_seqlens, silu) = inputs
    _, _, _, new_conv, increment, totals = output
    ctx.mark_non_differentiable(new_conv, increment, totals)
    ctx.set_materialize_grads(False)  # no zeros made for the outputs the loss does not reach (the final phase, ...)
    ctx.silu, ctx.has_initial_phase = silu, initial_phase is not None
    ctx.save_for_backward(q, k, x, down, up, conv_weight, bias, gate_weight, gate_bias, temperature, conv_state,
                          lengths, cu_seqlens, increment, totals)


def _backward(ctx, grad_q, grad_k, grad_final, _new_conv, _increment, _totals, backward=_backward_op):
    saved = ctx.saved_tensors
    q, k = saved[:2]
    grad_q = torch.zeros_like(q) if grad_q is None else grad_q
    grad_k = torch.zeros_like(k) if grad_k is None else grad_k
    needs = ctx.needs_input_grad
    dq, dk, dtemp, dinit, phase_grads = backward(*saved, grad_q, grad_k, grad_final, ctx.silu, needs[9])
    given = iter(phase_grads)
    # inputs 2-8: x, down, up, conv_weight, bias, gate_weight, gate_bias (a gradient for each one given)
    phase = [None if saved[2 + i] is None else next(given) for i in range(len(_PHASE_INPUTS))]
    phase = [grad if needs[2 + i] else None for i, grad in enumerate(phase)]
    return (dq, dk, *phase, dtemp if needs[9] else None, dinit if ctx.has_initial_phase else None,
            None, None, None, None)


_forward_op.register_autograd(_backward, setup_context=_setup_context)


class _EagerFused(torch.autograd.Function):
    """``rotary_from_input`` and its autograd for plain eager calls (``rotary_triton._plain_eager_call``): the custom
    ops' functions without their dispatch layers, as ``rotary_triton._EagerRotary``."""

    @staticmethod
    def forward(ctx, *inputs):
        outputs = _forward_impl(*inputs)
        _setup_context(ctx, inputs, outputs)
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        # A backward that builds a graph (create_graph=True) calls the custom op, which says it has no derivative.
        backward = _backward_op if torch.is_grad_enabled() else _backward_impl
        return _backward(ctx, *grads, backward=backward)


def selective_rotary_from_input_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    x: torch.Tensor,
    down: torch.Tensor,
    up: torch.Tensor,
    gate_weight: torch.Tensor | None,
    gate_bias: torch.Tensor | None,
    temperature: torch.Tensor,
    initial_phase: torch.Tensor | None = None,
    conv_state: torch.Tensor | None = None,
    conv_weight: torch.Tensor | None = None,
    conv_activation: str | None = None,
    bias: torch.Tensor | None = None,
    lengths: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """Selective RoPE of a sequence from the layer's input, for the default phase path: what the module's
    ``phase_increment`` followed by ``rotary_triton.selective_rotary_triton`` compute (equal within float64 rounding,
    which the increments' rounding to float32 absorbs), in two launches (three with the per-head gate).

    Args:
        q: ``(B, T, Hq, D)``; k: ``(B, T, Hk, D)`` with ``Hq % Hk == 0``.
        x: ``(B, T, Hk * Dc)`` the phase input (any float dtype).
        down, up, gate_weight, gate_bias, conv_weight, conv_activation, bias: the phase path's weights, as
            ``phase_triton.phase_increment_triton`` takes them (``conv_weight`` ``(Hk * R, K)``, or a depthwise
            ``nn.Conv1d``'s ``(Hk * R, 1, K)`` weight as it is: its gradient has its shape).
        temperature: ``(R,)``, ``2R <= D``.
        initial_phase: ``(N, Hk, R)`` (or broadcastable to it) the cached phase (float64), or ``None`` (a sequence
            start).
        conv_state: ``(N, K-1, Hk * R)`` the convolution's cached history (float64), or ``None``.
        lengths: ``(B,)`` real tokens per right-padded row, or ``None``.
        cu_seqlens: ``(N + 1,)`` packed sequences' offsets (``B == 1``), or ``None``.

    Returns:
        Rotated ``q`` and ``k`` (their dtypes), the final phase ``(N, Hk, R)`` float64 and the convolution's new
        history (``None`` without one), differentiable in q, k, x, the weights, the temperature and the initial
        phase; or ``None`` for an empty call (no token, sequence or frequency), which the caller runs unfused.
    """
    _check_shapes(q, k, temperature, cu_seqlens)
    num_seqs, conv_k = _check_phase_inputs(None, x, down, up, conv_weight, conv_activation, bias, gate_weight,
                                           gate_bias, lengths, cu_seqlens, conv_state)
    num_key_heads, rotary_pairs = k.shape[2], temperature.shape[-1]
    if x.shape[:2] != q.shape[:2] or down.shape[0] != num_key_heads or up.shape[1] != rotary_pairs:
        raise ValueError(f"x {tuple(x.shape)}, down {tuple(down.shape)} and up {tuple(up.shape)} disagree with "
                         f"q {tuple(q.shape)}, k {tuple(k.shape)} and R={rotary_pairs}")
    phase_shape = (num_seqs, num_key_heads, rotary_pairs)
    if initial_phase is not None and initial_phase.shape != phase_shape:
        try:  # broadcastable, as selective_rotary_triton takes it (autograd sums the gradient back)
            initial_phase = initial_phase.expand(phase_shape)
        except RuntimeError:
            raise ValueError(f"initial_phase {tuple(initial_phase.shape)} disagrees with {num_seqs} sequences, "
                             f"{num_key_heads} key heads and R={rotary_pairs}") from None
    if q.shape[1] == 0 or num_seqs == 0 or rotary_pairs == 0:
        return None
    if cu_seqlens is not None:
        cu_seqlens = _dense(cu_seqlens, torch.int32)
    if lengths is not None:
        lengths = _dense(lengths, torch.int64)
    inputs = (q, k, x, down, up, conv_weight, bias, gate_weight, gate_bias, _as(temperature, torch.float32),
              _dense(initial_phase, torch.float64), _dense(conv_state, torch.float64),
              lengths, cu_seqlens, conv_activation == "silu")
    if not _plain_eager_call(inputs):
        outputs = _forward_op(*inputs)
    elif torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs):
        outputs = _EagerFused.apply(*inputs)
    else:
        outputs = _forward_impl(*inputs)  # nothing to differentiate
    out_q, out_k, final, new_conv = outputs[:4]
    return out_q, out_k, final, new_conv if conv_k > 0 else None
