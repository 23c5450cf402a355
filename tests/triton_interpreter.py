"""Running flash-linear-attention's Triton kernels on CPU, under Triton's interpreter (``TRITON_INTERPRET=1``, set by
``conftest.py`` before triton is first imported). Test code only: production never calls fla on CPU.

fla 0.6.0's kernels run there unchanged once two limits of the interpreter are worked around, for as long as
:func:`fla_kernels_on_cpu` is active:

- autotuned kernels benchmark their configurations on a device, and the interpreter has none ("0 active drivers"):
  every configuration gets the same timing, so the autotuner keeps the first one;
- the interpreter runs ``for i in range(n)`` with Python ints, while fla calls tensor methods on loop variables
  (``i_t.to(tl.int64)`` in ``fla/ops/common/chunk_h.py``): the loop body gets its variable as a tensor, as compiled
  Triton gives it.

Keep these runs in float32: the 3.9 interpreter computes bf16 ``tl.dot`` on raw bit patterns.
"""

from __future__ import annotations

import ast
import contextlib
from collections import Counter
from types import SimpleNamespace

import pytest
from triton.runtime import autotuner, interpreter

from selective_rope.kernels import dispatch


def _equal_timings(self, *args, config, **meta):
    return [0.0, 0.0, 0.0]  # (median, 20th, 80th percentile) as do_bench reports them


class _TensorLoopVariables(interpreter.ASTTransformer):
    """The interpreter's rewriting of a kernel's source, plus ``i = <to tensor>(i)`` at the top of every
    ``for i in range(...)`` / ``tl.range(...)`` body (``tl.static_range`` variables stay compile-time ints)."""

    def visit_For(self, node: ast.For) -> ast.For:
        node = self.generic_visit(node)
        func = node.iter.func if isinstance(node.iter, ast.Call) else None
        name = getattr(func, "id", None) or getattr(func, "attr", None)
        if isinstance(node.target, ast.Name) and name == "range":
            # visit_Assign wraps the value in interpreter_semantic.to_tensor, as for any assignment in a kernel
            rebind = ast.Assign(targets=[ast.Name(id=node.target.id, ctx=ast.Store())],
                                value=ast.Name(id=node.target.id, ctx=ast.Load()))
            node.body.insert(0, ast.copy_location(self.visit_Assign(rebind), node))
        return node


def counting(ops: SimpleNamespace, calls: Counter) -> SimpleNamespace:
    """``ops`` with every call counted under its name, and under ``name + "[packed]"`` when given ``cu_seqlens`` (also
    used by tests/kernels/test_backend_parity.py)."""
    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            if kwargs.get("cu_seqlens") is not None:
                calls[name + "[packed]"] += 1
            return fn(*args, **kwargs)
        return wrapper

    return SimpleNamespace(**{name: counted(name, fn) for name, fn in vars(ops).items()})


@contextlib.contextmanager
def fla_kernels_on_cpu():
    """While active, ``backend="triton"`` on CPU tensors runs fla's mixer kernels (in the interpreter) where it would
    on CUDA. Yields a ``Counter`` of the calls of each fla op and of our Triton rotary ops (``selective_rotary_triton``,
    and ``selective_rotary_from_input_triton`` for the default phase path), packed calls counted again under
    ``"<name>[packed]"``. Everything is restored on exit."""
    if not dispatch.interpreting():
        raise RuntimeError("fla's kernels run on CPU only under TRITON_INTERPRET=1, set before triton is imported")
    fla = dispatch._import_fla()
    if fla is None:
        pytest.skip("flash-linear-attention is not installed")
    calls: Counter = Counter()
    ops = counting(fla, calls)
    rotary, fused = dispatch.triton_rotary(), dispatch.triton_rotary_from_input()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(autotuner.Autotuner, "_bench", _equal_timings)
        patch.setattr(interpreter.FunctionRewriter, "ast_transformer", _TensorLoopVariables())
        # Kernels are rewritten once and cached: start from an empty cache, and drop the patched rewrites on exit.
        patch.setattr(interpreter.InterpretedFunction, "rewritten_fn", {})
        # The production rule (fla_ops) with CPU tensors let through, and the counting kernels in place of fla's.
        patch.setattr(dispatch, "FLA_DEVICES", ("cuda", "cpu"))
        patch.setitem(dispatch._imported, "fla", ops)
        patch.setattr(rotary, "selective_rotary_triton",
                      counting(SimpleNamespace(selective_rotary_triton=rotary.selective_rotary_triton),
                               calls).selective_rotary_triton)
        from_input = SimpleNamespace(selective_rotary_from_input_triton=fused.selective_rotary_from_input_triton)
        patch.setattr(fused, "selective_rotary_from_input_triton",
                      counting(from_input, calls).selective_rotary_from_input_triton)
        yield calls
