"""Where one call of the Triton Selective RoPE op spends its time: the host (Python, torch glue, kernel launches)
against the GPU.

The first H200 runs (benchmarks/results/gpu/2026-11-27-h200) timed a decode step at ~360 us and a B=1, T=32k forward
at 0.97 ms when each call was synchronised, but 0.55 ms when the CPU could run ahead: the host side of a call seems to
cost hundreds of microseconds. This script measures it directly, per call (median of ``--repeats``):

- ``enqueue``: host time until the call returns (nothing synchronised: what the CPU spends);
- ``device``: CUDA-event time of the same call run back to back with the others (the GPU's own time, launch gaps
  hidden when the host keeps ahead);
- ``synchronised``: call + synchronize, from an idle GPU (what the benchmark measures);
then, per call, the host time of each Triton launch (Triton's launcher: argument binding, specialisation, cache
lookup, the driver call) and what is left for Python and torch around them, with the backward op also called
alone (``backward_op``: no autograd engine around it) and the models' decoding step (``decode_from_input``: the
phase inputs computed in the same launch); and prints torch.profiler's table (self CPU time per op,
kernels' CUDA time) for a few calls of each.

Usage::

    python benchmarks/profile_rotary_gpu.py                   # B=1, T=2048, bf16, on CUDA
    python benchmarks/profile_rotary_gpu.py --seq-len 32768
    TRITON_INTERPRET=1 python benchmarks/profile_rotary_gpu.py --device cpu --seq-len 64   # smoke run, no GPU
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from bench_rotary_gpu import HEAD_DIM, HEADS, PAIRS, decode_inputs, decode_triton, prefill_inputs


def calls(batch: int, seq_len: int, dtype: torch.dtype, device: str) -> dict:
    """The calls, on ``bench_rotary_gpu.py``'s inputs (so the profile explains its numbers), and the decoding step
    the models take (``decode_from_input``: the phase inputs computed in the same launch, from a 370M-class layer's
    input: hidden 1024 in 16 chunks of 64, rank 32, a per-head gate)."""
    from selective_rope.kernels import rotary_triton
    from selective_rope.kernels.rotary_triton import selective_rotary_triton

    q, k, increment, temperature, _ = prefill_inputs(batch, seq_len, dtype, requires_grad=True, device=device)
    grads = [torch.randn_like(x) for x in (q, k)]
    decode = decode_inputs(batch, dtype, device)

    def forward():
        with torch.no_grad():
            return selective_rotary_triton(q, k, increment, temperature)

    def forward_backward():
        out_q, out_k, _ = selective_rotary_triton(q, k, increment, temperature)
        return torch.autograd.grad((out_q, out_k), (q, k, increment), grads)

    plain = [x.detach() for x in (q, k, *grads, increment, temperature)]

    def backward_op():  # what the autograd node calls, without the engine and the node around it
        q_, k_, grad_q, grad_k, increment_, temperature_ = plain
        return rotary_triton._rotary_backward_impl(q_, k_, grad_q, grad_k, None, increment_, temperature_, None, None,
                                                   True)

    q1, k1, _, temperature1, phase1, history1, taps1, _, _ = decode
    batch1, hidden, rank = q1.shape[0], 1024, 32
    weights = [torch.randn(*shape, device=device) for shape in ((HEADS, rank, hidden // HEADS), (HEADS, PAIRS, rank),
                                                                 (HEADS, hidden), (HEADS,))]
    x = torch.randn(batch1, hidden, device=device, dtype=dtype)

    def decode_from_input():
        return rotary_triton.selective_rotary_decode_from_input_triton(q1, k1, x, *weights, temperature1, phase1,
                                                                       history1, taps1)

    return {"forward": forward, "forward_backward": forward_backward, "backward_op": backward_op,
            "decode": lambda: decode_triton(*decode), "decode_from_input": decode_from_input}


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def host_times(fn, repeats: int, device: str, warmup: int = 3) -> tuple[list[float], list[float]]:
    """Seconds per call of ``repeats`` calls, each from an idle GPU: until ``fn`` returns (what the host spends) and
    until the GPU has finished it, after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    sync(device)
    enqueue, synchronised = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        enqueue.append(time.perf_counter() - start)
        sync(device)
        synchronised.append(time.perf_counter() - start)
    return enqueue, synchronised


def measure(fn, repeats: int, device: str) -> dict:
    enqueue, synchronised = host_times(fn, repeats, device, warmup=5)
    result = {"enqueue_us": 1e6 * statistics.median(enqueue), "synchronised_us": 1e6 * statistics.median(synchronised)}
    if device == "cuda":
        result["device_us"] = device_us(fn, repeats)
    return result


def device_us(fn, repeats: int) -> float:
    """Median GPU time of ``fn`` in microseconds: CUDA events around each of ``repeats`` calls run back to back (launch
    gaps hidden while the host keeps ahead)."""
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return 1e3 * statistics.median(start.elapsed_time(end) for start, end in events)


def profile_table(fn, calls: int, device: str, sort_by: str, rows: int) -> str:
    """torch.profiler's table (CPU, and CUDA kernels on a GPU) of ``calls`` calls of ``fn``."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as profile:
        for _ in range(calls):
            fn()
        sync(device)
    return profile.key_averages().table(sort_by=sort_by, row_limit=rows)


class _TimedLaunches:
    """Stands in for the Triton kernels of ``rotary_triton`` (the module-level names ending in ``_kernel``, looked up
    at each call) and records the host time of each launch, by kernel."""

    def __init__(self):
        from selective_rope.kernels import rotary_triton

        self.module = rotary_triton
        self.kernels = {name: kernel for name, kernel in vars(rotary_triton).items() if name.endswith("_kernel")}
        self.times: dict[str, list[float]] = {}

    def _timed(self, name: str, kernel):
        times = self.times.setdefault(name, [])

        class Timed:
            def __getitem__(self, grid):
                def launch(*args, **kwargs):
                    start = time.perf_counter()
                    kernel[grid](*args, **kwargs)
                    times.append(time.perf_counter() - start)
                return launch
        return Timed()

    def __enter__(self):
        for name, kernel in self.kernels.items():
            setattr(self.module, name, self._timed(name, kernel))
        return self

    def __exit__(self, *exc):
        for name, kernel in self.kernels.items():
            setattr(self.module, name, kernel)


def launch_breakdown(fn, repeats: int, device: str) -> str:
    """One line: each kernel's launches per call and median host time per launch, the call's median host time
    (enqueue) and what is left of it for Python and torch (enqueue minus the launches)."""
    for _ in range(3):  # outside the recording: only the timed calls' launches count
        fn()
    with _TimedLaunches() as timed:
        enqueue, _ = host_times(fn, repeats, device, warmup=0)
    total = 1e6 * statistics.median(enqueue)
    parts, launches = [], 0.0
    for name, times in timed.times.items():
        if times:
            per_call = len(times) / repeats
            launches += per_call * 1e6 * statistics.median(times)
            parts.append(f"{name} {per_call:g} x {1e6 * statistics.median(times):.1f}")
    return f"enqueue {total:.1f} = launches {launches:.1f} ({', '.join(parts)}) + the rest {total - launches:.1f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--rows", type=int, default=12, help="rows of each profiler table")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("profile_rotary_gpu.py: no CUDA device (use --device cpu with TRITON_INTERPRET=1 for a smoke run)")

    fns = calls(args.batch, args.seq_len, getattr(torch, args.dtype), args.device)
    print(f"Selective RoPE op, B={args.batch}, T={args.seq_len}, {args.dtype}, H={HEADS}, D={HEAD_DIM}, R={PAIRS}, "
          f"{torch.cuda.get_device_name(0) if args.device == 'cuda' else 'cpu'}; median us per call")
    for name, fn in fns.items():
        row = measure(fn, args.repeats, args.device)
        print(f"  {name:17s} " + "  ".join(f"{key[:-3]} {value:9.1f}" for key, value in row.items()), flush=True)
    print("host time of the Triton launches in each call (median us; launches per call x us per launch):")
    for name, fn in fns.items():
        print(f"  {name:17s} {launch_breakdown(fn, args.repeats, args.device)}", flush=True)

    for name, fn in fns.items():
        print(f"\n{name}: 5 calls")
        print(profile_table(fn, 5, args.device, "self_cpu_time_total", args.rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
