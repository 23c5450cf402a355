"""Host time of the Triton path's calls, measured on a CPU with the Triton launches stubbed out: the Python and torch
work around the kernels, which on a lent GPU machine is most of a decoding step (run 4 on an H200: each
Triton launch 47-87 us of host time on top, and the decode op's Python there ~3.5x this VM's: 61 against ~17.5 us).

Measures, interleaved round by round (medians, microseconds):

- ``decode``: one decoding step of a 370M FoX layer's rotary module (``SelectiveRotaryEmbedding`` forward on the
  Triton backend, one token, bf16), RoPE and Selective RoPE (the default phase path: one launch);
- ``train``: the rotary op's forward + backward in eager training (B=1, T=256, 16 heads of 64), through the eager
  autograd path the models take and through the custom op (what compiled and traced calls take).

No GPU, and no interpreter: the kernels never run (their launches return at once), so the outputs are garbage and
only the time around the launches is real.

Usage::

    python benchmarks/host_time_cpu.py            # both
    python benchmarks/host_time_cpu.py --part decode --rounds 40
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_models_gpu import MODEL_CONFIGS  # noqa: E402


class _NoLaunch:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](*args)`` returns at once."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def stub_launches():
    from selective_rope.kernels import dispatch

    rotary_triton = dispatch.triton_rotary()
    for name in [name for name in vars(rotary_triton) if name.endswith("_kernel")]:
        setattr(rotary_triton, name, _NoLaunch())
    return rotary_triton


def decode_calls() -> dict:
    from selective_rope.families import FAMILIES
    from selective_rope.modeling.rotary import SelectiveRotaryEmbedding

    calls = {}
    for variant in ("rope", "selective_rope"):
        config = FAMILIES["fox"].config_class(**{**MODEL_CONFIGS["fox"], "num_hidden_layers": 1},
                                              position_embedding=variant)
        module = next(m for m in FAMILIES["fox"].lm_class(config).modules() if isinstance(m, SelectiveRotaryEmbedding))
        heads, head_dim = config.num_attention_heads, config.hidden_size // config.num_attention_heads
        x = torch.randn(1, 1, config.hidden_size, dtype=torch.bfloat16)
        q = torch.randn(1, 1, heads, head_dim, dtype=torch.bfloat16)
        k = torch.randn(1, 1, module.num_key_heads, head_dim, dtype=torch.bfloat16)
        state = {"phase": torch.zeros(1, module.num_key_heads, module.rotary_pairs, dtype=torch.float64)}
        if getattr(module, "phase_conv", None) is not None:  # (RoPE has no phase modules)
            history = module.phase_conv.taps(x.device).shape[-1] - 1
            state["phase_conv"] = torch.zeros(1, history, module.num_key_heads * module.rotary_pairs,
                                              dtype=torch.float64)

        def step(module=module, x=x, q=q, k=k, state=state):
            with torch.no_grad():
                module(x, q, k, state=state, backend="triton")

        calls[f"decode {variant}"] = step
    return calls


def train_calls(rotary_triton) -> dict:
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=["decode", "train", "both"], default="both")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--calls", type=int, default=200, help="calls per round and case")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rotary_triton = stub_launches()
    calls = {}
    if args.part in ("decode", "both"):
        calls.update(decode_calls())
    if args.part in ("train", "both"):
        calls.update(train_calls(rotary_triton))
    times = {name: [] for name in calls}
    for call in calls.values():  # warm-up
        for _ in range(20):
            call()
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
        print(f"  {name:24s} {statistics.median(values):7.1f} us  [{quartiles[0]:.1f}-{quartiles[2]:.1f}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
