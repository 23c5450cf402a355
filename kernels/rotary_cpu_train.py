"""Selective RoPE's rotary module in training on the CPU: the compiled forward (``rotary_cpu``, the inference
kernel's own code, which also keeps the float32 increments) and its compiled backward, as one autograd Function.

Why. The torch path's phase path is float64 by design (``modeling/rotary.py``); with autograd its forward and
backward are ~40 float64 passes over ``(B, T, Hk, R)`` and ``(B, T, D)`` tensors, 4-6x RoPE's module in a training
step at small widths (docs/cpu_performance.md, issue 51). The C forward keeps the phase path's float64 values (the
normalisation's denominators, the projection's, the gate's: ``RotaryPlan.saved_size`` values, ~2 KB a token at
hidden 256) so that the backward need not compute them again (a quarter of its time). The backward walks each row
once backwards (the rotation's gradient, the reverse cumulative sum of ``d θ``) and once forwards (the gate, bias,
activation, convolution, projection and normalisation), summing the parameters' gradients in float64. See
``rotary_cpu.C_SOURCE`` (``selective_rope_rotary_backward``).

What it computes: exactly the forward of the inference path (the same q, k and phase, bit for bit) and the gradients
of the torch path to rounding (float64 sums in another order; tests: ``tests/kernels/test_rotary_cpu_train.py``), the
same on any number of threads (rows are split into a fixed number of parts, summed in order). The new convolution
history it returns carries no gradient. A double backward (``create_graph=True``) recomputes the module on the torch
path and differentiates that, so it has the torch path's second derivatives. The backward reads the parameters where
they are at backward time (FSDP gathers them anew); one it cannot read then sends the backward to the torch path.
"""

from __future__ import annotations

import torch

from .rotary_cpu import RotaryPlan


class CompiledRotaryTraining(torch.autograd.Function):
    """``(x, q, k, phase, *parameters)`` -> rotated q and k, the final phase and the new convolution history.

    ``parameters`` are the plan's tensors in ``RotaryPlan.gradient_order`` (``None`` where absent), passed so that
    autograd routes their gradients; the plan reads the same tensors. ``module`` is the rotary module, used only by a
    double backward (its torch path)."""

    @staticmethod
    def forward(ctx, plan: RotaryPlan, module, lengths, x, q, k, phase, *parameters):
        batch, seq_len = q.shape[:2]
        channels = plan.sizes[1] * plan.sizes[3]
        increments = torch.empty((batch, seq_len, channels), dtype=torch.float32, device="cpu")
        saved = torch.empty(plan.saved_size(batch, seq_len), dtype=torch.float64, device="cpu")
        result = plan.try_call(x, q, k, phase, None, lengths, increments=increments, saved=saved)
        if result is None:  # the caller checked `plan.takes` and `seq_len`
            raise RuntimeError("the compiled CPU rotary kernel declined a call it had accepted")
        q_out, k_out, new_phase, new_history = result
        ctx.plan, ctx.module, ctx.lengths = plan, module, lengths
        ctx.save_for_backward(x, q, k, phase, increments, saved, *parameters)
        if new_history is not None:
            ctx.mark_non_differentiable(new_history)
        ctx.set_materialize_grads(False)
        return q_out, k_out, new_phase, new_history

    @staticmethod
    def backward(ctx, grad_q, grad_k, grad_phase, _grad_history):
        # (saved_tensors checks that nothing was modified in place)
        x, q, k, phase, increments, saved, *parameters = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: differentiate the torch path instead
            return (None, None, None) + torch_path_gradients(ctx, x, q, k, phase, grad_q, grad_k, grad_phase)
        grad_q, grad_k = (torch.zeros_like(rotated) if grad is None else last_dim_contiguous(grad.to(rotated.dtype))
                          for grad, rotated in ((grad_q, q), (grad_k, k)))
        if grad_phase is not None:
            grad_phase = grad_phase.to(torch.float64).contiguous()
        needs = ctx.needs_input_grad
        result = ctx.plan.backward(x, q, k, grad_q, grad_k, increments, saved, phase, grad_phase, ctx.lengths,
                                   tuple(parameters), phase_grad=phase is not None and needs[6])
        if result is None:  # a parameter the C code can no longer read: differentiate the torch path
            return (None, None, None) + torch_path_gradients(ctx, x, q, k, phase, grad_q, grad_k, grad_phase)
        dx, dq, dk, d_phase, d_params = result
        grads = [None if g is None or not need else g.to(p.dtype)
                 for g, p, need in zip(d_params, parameters, needs[7:])]
        rope = ctx.plan.gradient_order[1] is None  # RoPE: x does not reach the phase
        return (None, None, None, dx if needs[3] and not rope else None, dq if needs[4] else None,
                dk if needs[5] else None, None if d_phase is None else d_phase.to(phase.dtype), *grads)


def last_dim_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as the C backward reads it: any strides but the last (the attention's backward leaves the gradients
    of q and k (B, H, T, D) transposed; copying them would cost a pass over each)."""
    return tensor if tensor.stride(-1) == 1 else tensor.contiguous()


def torch_path_gradients(ctx, x, q, k, phase, grad_q, grad_k, grad_phase):
    """The gradients of ``(x, q, k, phase, *parameters)`` through the module's torch path, recomputed with a graph (a
    double backward differentiates these; a first backward only sums them). The parameters are the module's own
    tensors (the plan's)."""
    inputs, parameters = (x, q, k, phase), list(ctx.plan.gradient_order)
    create_graph = torch.is_grad_enabled()
    with torch.enable_grad():
        leaves = [None if t is None else t.detach().requires_grad_(need)
                  for t, need in zip(inputs[:4], ctx.needs_input_grad[3:7])]
        state = {} if leaves[3] is None else {"phase": leaves[3]}
        q_out, k_out, new_state = ctx.module(leaves[0], leaves[1], leaves[2], state, ctx.lengths, backend="torch")
        outputs, grads = [], []
        for output, grad in ((q_out, grad_q), (k_out, grad_k), (new_state["phase"], grad_phase)):
            if grad is not None and output.requires_grad:
                outputs.append(output)
                grads.append(grad)
        wanted = [t for t, need in zip(leaves + parameters, ctx.needs_input_grad[3:]) if need and t is not None]
        found = iter(torch.autograd.grad(outputs, wanted, grads, create_graph=create_graph, allow_unused=True)
                     if outputs and wanted else [None] * len(wanted))
    return tuple(next(found) if need and t is not None else None
                 for t, need in zip(leaves + parameters, ctx.needs_input_grad[3:]))
