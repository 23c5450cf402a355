"""Host time of the Triton path's calls, measured on a CPU with the Triton launches stubbed out: the Python and torch
work around the kernels, which on a lent GPU machine is most of a decoding step (run 4 on an H200: each
Triton launch 47-87 us of host time on top, and the decode op's Python there ~3.5x this VM's: 61 against ~17.5 us).

Measures, interleaved round by round (medians, microseconds):

- ``decode``: one decoding step of a 370M layer's rotary module (``SelectiveRotaryEmbedding`` forward on the
  Triton backend, one token, bf16 q and k, the float32 phase input the models pass), FoX's and GLA's shapes (16 key
  heads of 64 against 4 of 128), RoPE and Selective RoPE (the default phase path: one launch);
- ``train``: the rotary op's forward + backward in eager training (B=1, T=256, 16 heads of 64), through the eager
  autograd path the models take and through the custom op (what compiled and traced calls take);
- ``layer``: one 370M FoX layer's whole Selective RoPE in training, forward + backward, what a training step pays per
  layer on the host: through the fused op from the input (``rotary_fused_triton``: 4 launches), and unfused (the
  phase path in PyTorch, then the rotary op: the path before issue 46, and still other phase paths'). At B=1, T=16:
  the PyTorch phase ops really run here (on a GPU they are queued), so a short sequence keeps their arithmetic out of
  the host time.

``--count`` prints, instead of times, each case's Triton launches (by kernel) and its top-level aten ops (by name,
from ``torch.profiler``; an op called inside another op is not counted again): the budget
``tests/kernels/test_launch_budget.py`` holds the code to.

No GPU, and no interpreter: the kernels never run (their launches return at once), so the outputs are garbage and
only the time around the launches is real.

Usage::

    python benchmarks/host_time_cpu.py            # every part
    python benchmarks/host_time_cpu.py --part decode --rounds 40
    python benchmarks/host_time_cpu.py --count
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_models_gpu import MODEL_CONFIGS  # noqa: E402

PARTS = ("decode", "train", "layer")


class _CountingLaunch:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](*args)`` counts the launch and returns at once."""

    def __init__(self, name: str, launches: Counter):
        self.name, self.launches = name, launches

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches[self.name] += 1
        return launch


@contextlib.contextmanager
def stubbed_launches():
    """Replaces every kernel of ``rotary_triton`` and ``phase_triton`` (the module-level names ending in ``_kernel``,
    looked up at each call) by a no-op launcher for the duration; yields the ``Counter`` of launches by kernel name."""
    from selective_rope.kernels import dispatch, phase_triton

    modules = (dispatch.triton_rotary(), phase_triton)
    kernels = [(module, name, kernel) for module in modules for name, kernel in vars(module).items()
               if name.endswith("_kernel")]
    launches = Counter()
    for module, name, _ in kernels:
        setattr(module, name, _CountingLaunch(name, launches))
    try:
        yield launches
    finally:
        for module, name, kernel in kernels:
            setattr(module, name, kernel)


def top_level_ops(fn) -> Counter:
    """The aten ops ``fn()`` calls (forward and backward), by name, each counted once where it is called: not the ops
    it calls in turn (``aten::linear`` is one op, not its ``t`` and ``addmm``). Each is a dispatch on the host, ~10-25
    us on the lent GPU machine."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        fn()
    ops = Counter()
    for event in profile.events():
        if not event.name.startswith("aten::"):
            continue
        parent = event.cpu_parent
        while parent is not None and not parent.name.startswith("aten::"):
            parent = parent.cpu_parent
        if parent is None:
            ops[event.name] += 1
    return ops


def rotary_module(family: str, variant: str):
    """One 370M layer's rotary module (``bench_models_gpu.py``'s configurations) and its query head count."""
    from selective_rope.families import FAMILIES
    from selective_rope.modeling.rotary import SelectiveRotaryEmbedding

    config = FAMILIES[family].config_class(**{**MODEL_CONFIGS[family], "num_hidden_layers": 1},
                                           position_embedding=variant)
    module = next(m for m in FAMILIES[family].lm_class(config).modules() if isinstance(m, SelectiveRotaryEmbedding))
    groups = config.num_attention_heads // config.num_key_value_heads if family == "fox" else 1
    return config, module, module.num_key_heads * groups


def decode_calls() -> dict:
    calls = {}
    for family in ("fox", "gla"):
        for variant in ("rope", "selective_rope"):
            config, module, heads = rotary_module(family, variant)
            head_dim = module.rotary_dim
            x = torch.randn(1, 1, config.hidden_size)  # the models' phase input: float32 in a bf16 model
            q = torch.randn(1, 1, heads, head_dim, dtype=torch.bfloat16)
            k = torch.randn(1, 1, module.num_key_heads, head_dim, dtype=torch.bfloat16)
            state = {"phase": torch.zeros(1, module.num_key_heads, module.rotary_pairs, dtype=torch.float64)}
            if getattr(module, "phase_conv", None) is not None:  # (RoPE has no phase modules)
                history = module.phase_conv.taps(x.device).shape[-1] - 1
                state["phase_conv"] = torch.zeros(1, history, module.num_key_heads * module.rotary_pairs,
                                                  dtype=torch.float64)

            def step(module=module, x=x, q=q, k=k, state=state):
                with torch.no_grad():
                    module(x, q, k, state=state, backend="triton", overwrite_state=True)

            calls[f"decode {family} {variant}"] = step
    return calls


def train_calls() -> dict:
    from selective_rope.kernels import dispatch

    rotary_triton = dispatch.triton_rotary()
    q, k = (torch.randn(1, 256, 16, 64, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    increment, temperature = torch.rand(1, 256, 16, 32, requires_grad=True), torch.rand(32) + 1
    grad = torch.randn(1, 256, 16, 64, dtype=torch.bfloat16)

    def through(forward):
        def call():
            q.grad = k.grad = increment.grad = None
            out_q, out_k, _ = forward(q, k, increment, temperature, None, None)
            torch.autograd.backward([out_q, out_k], [grad, grad])
        return call

    return {"train eager autograd": through(rotary_triton.selective_rotary_triton),
            "train custom op": through(rotary_triton._rotary_forward)}


def layer_calls(seq_len: int = 16) -> dict:
    config, module, heads = rotary_module("fox", "selective_rope")
    x = torch.randn(1, seq_len, config.hidden_size, requires_grad=True)
    q = torch.randn(1, seq_len, heads, module.rotary_dim, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, seq_len, module.num_key_heads, module.rotary_dim, dtype=torch.bfloat16, requires_grad=True)
    grad_q, grad_k = torch.randn_like(q), torch.randn_like(k)

    from selective_rope.kernels import rotary

    def call():
        module.zero_grad(set_to_none=True)
        x.grad = q.grad = k.grad = None
        out_q, out_k, _ = module(x, q, k, backend="triton")
        torch.autograd.backward([out_q, out_k], [grad_q, grad_k])

    def unfused():
        saved = rotary.sequence_from_input_triton
        rotary.sequence_from_input_triton = lambda *args: None  # (declines: the module's increments, the rotary op)
        try:
            call()
        finally:
            rotary.sequence_from_input_triton = saved

    return {"layer fox selective_rope": call, "layer unfused (torch phase)": unfused}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=[*PARTS, "all"], default="all")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--calls", type=int, default=200, help="calls per round and case")
    parser.add_argument("--count", action="store_true", help="print launches and aten ops per call, not times")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    parts = PARTS if args.part == "all" else (args.part,)
    with stubbed_launches() as launches:
        calls = {}
        for part, make in (("decode", decode_calls), ("train", train_calls), ("layer", layer_calls)):
            if part in parts:
                calls.update(make())
        for call in calls.values():  # warm-up
            for _ in range(1 if args.count else 20):
                call()
        if args.count:
            print(f"per call, Triton launches stubbed, torch {torch.__version__}")
            for name, call in calls.items():
                launches.clear()
                ops = top_level_ops(call)
                kernels = ", ".join(f"{kernel} x{n}" for kernel, n in sorted(launches.items()))
                print(f"  {name:28s} {sum(launches.values())} launches ({kernels}), {sum(ops.values())} aten ops")
                print(f"      {', '.join(f'{op[6:]} x{n}' for op, n in ops.most_common())}")
            return 0
        times = {name: [] for name in calls}
        for _ in range(args.rounds):
            for name, call in calls.items():
                start = time.perf_counter()
                for _ in range(args.calls):
                    call()
                times[name].append((time.perf_counter() - start) / args.calls * 1e6)
    print(f"host time per call, Triton launches stubbed (median of {args.rounds} interleaved rounds), torch "
          f"{torch.__version__}, 1 thread")
    for name, values in times.items():
        quartiles = statistics.quantiles(values, n=4)
        print(f"  {name:28s} {statistics.median(values):8.1f} us  [{quartiles[0]:.1f}-{quartiles[2]:.1f}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
