"""Where an eager decoding step of a 370M model spends its time, NoPE against Selective RoPE.

Issue 46's question: on an H200 (28 Nov 2026, benchmarks/results/gpu/2026-11-28-h200) GLA decoded at 51.2 ms/token
with Selective RoPE against 22.4 with NoPE (~1.2 ms more per layer and token), FoX's eager step costs ~0.46 ms more
per layer, while on the CPU, with the Triton launches stubbed, both families' rotary step is the same single fused
launch and ten aten ops (five since: tests/kernels/test_launch_budget.py, ``benchmarks/host_time_cpu.py --count``).
So the extra time is not a missed fusion; this script measures where it goes. Per family and variant, one model at a
time (``bench_models_gpu.py``'s 370M configurations, bf16 weights, batch 1, after a prefill of ``--context`` tokens):

- ``step``: ms per token synchronised after every step (what ``bench_models_gpu.py`` reports), ``enqueue``: host time
  until the step returns, ``device``: CUDA-event time of steps run back to back;
- our rotary kernels' launches per step and the median host time of each (``profile_rotary_gpu._TimedLaunches``);
- torch.profiler's table of 3 steps, by self CPU time and by CUDA time.

Usage::

    python benchmarks/profile_decode_gpu.py                         # GLA and FoX, NoPE and Selective RoPE
    python benchmarks/profile_decode_gpu.py --families gla --variants nope rope selective_rope
    python benchmarks/profile_decode_gpu.py --device cpu --layers 1 --context 8 --steps 2   # smoke run, no GPU
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
from bench_models_gpu import MODEL_CONFIGS, SEED, cast_like_from_pretrained
from profile_rotary_gpu import _TimedLaunches, device_us, host_times, profile_table

from selective_rope.families import FAMILIES
from selective_rope.modeling import returned_cache


def decoding_step(family: str, variant: str, layers: int, context: int, device: str):
    """A function that decodes one token of the 370M ``family`` model (``layers`` layers) with its cache, after a
    prefill of ``context`` tokens."""
    torch.manual_seed(SEED)
    config = FAMILIES[family].config_class(**{**MODEL_CONFIGS[family], "num_hidden_layers": layers},
                                           position_embedding=variant)
    model = cast_like_from_pretrained(FAMILIES[family].lm_class(config).to(device), torch.bfloat16).eval()
    ids = torch.randint(0, config.vocab_size, (1, context), device=device)
    with torch.inference_mode():
        out = model(ids, use_cache=True)
    state = {"cache": returned_cache(out), "next": out.logits[:, -1:].argmax(-1)}

    @torch.inference_mode()
    def step():
        out = model(state["next"], past_key_values=state["cache"], use_cache=True)
        state["cache"], state["next"] = returned_cache(out), out.logits[:, -1:].argmax(-1)

    return step


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", nargs="+", default=["gla", "fox"], choices=sorted(MODEL_CONFIGS))
    parser.add_argument("--variants", nargs="+", default=["nope", "selective_rope"],
                        choices=["nope", "rope", "selective_rope"])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=30, help="timed steps per measurement")
    parser.add_argument("--rows", type=int, default=15, help="rows of each profiler table")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("profile_decode_gpu.py: no CUDA device (use --device cpu for a smoke run)")

    print(f"eager decoding step, batch 1, context {args.context}, {args.layers} layers, bf16 weights, "
          f"{torch.cuda.get_device_name(0) if args.device == 'cuda' else 'cpu'}")
    for family in args.families:
        for variant in args.variants:
            step = decoding_step(family, variant, args.layers, args.context, args.device)
            enqueue, synchronised = host_times(step, args.steps, args.device, warmup=4)
            row = (f"{family:14s} {variant:15s} step {1e3 * statistics.median(synchronised):7.2f} ms  "
                   f"enqueue {1e3 * statistics.median(enqueue):7.2f} ms")
            if args.device == "cuda":
                row += f"  device {device_us(step, args.steps) / 1e3:7.2f} ms"
            with _TimedLaunches() as timed:
                host_times(step, args.steps, args.device, warmup=0)
            launches = [f"{name} {len(times) / args.steps:g} x {1e6 * statistics.median(times):.1f} us"
                        for name, times in timed.times.items() if times]
            print(row + "  rotary launches per step: " + (", ".join(launches) or "none"), flush=True)
            for sort_by in ("self_cpu_time_total", "self_cuda_time_total" if args.device == "cuda" else None):
                if sort_by:
                    print(f"\n{family} {variant}: 3 steps, by {sort_by}")
                    print(profile_table(step, 3, args.device, sort_by, args.rows), flush=True)
            del step
            if args.device == "cuda":
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
