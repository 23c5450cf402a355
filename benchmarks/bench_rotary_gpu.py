"""GPU benchmark of the Selective RoPE op: torch eager, torch.compile and our Triton kernels.

Measures on one CUDA device, q and k in bfloat16 (``--dtype``; the phase math is float32 in every variant), with
H = 16 query and key heads of size 128 (R = 64 frequency pairs):

1. forward (cumulative phase + rotation of q and k), B in {1, 8}, T in {2048, 8192, 32768};
2. forward + backward (gradients of q, k, the increments, the temperature and the initial phase), same shapes;
3. the decode step (one token per row, B in {1, 8}): from the phase projection, a 4-tap convolution over the cached
   history, ``+ exp(b)``, a per-head sigmoid gate, the phase update and the rotation; the torch variants compose the
   same ops as the model's torch path.

Each result has the median time (CUDA events, after a warm-up; a 256 MiB buffer is overwritten before every timed
call so the inputs do not sit in L2), the achieved bandwidth under a minimal-traffic model (every tensor read or
written once, see ``traffic_bytes``), its fraction of the device's peak memory bandwidth (``PEAK_BANDWIDTH_GBPS``,
matched on the device name; ``--peak-gbps`` overrides) and the peak memory the call allocated.

Usage::

    python benchmarks/bench_rotary_gpu.py            # full run -> benchmarks/results/rotary_gpu.json
    python benchmarks/bench_rotary_gpu.py --quick    # B=1, T=2048 only

Needs a CUDA GPU with triton; exits with a message otherwise. ``bench_models_gpu.py`` imports the GPU helpers below.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from selective_rope.kernels.conv_torch import causal_conv1d
from selective_rope.kernels.rotary_torch import selective_rotary

from harness.machine import source_provenance
from harness.report import log, write_results
from harness.timing import summarize

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"

DEFAULT_OUTPUT = RESULTS_DIR / "rotary_gpu.json"
SOURCES = ["kernels/rotary_triton.py", "kernels/rotary_torch.py", "kernels/conv_torch.py", "kernels/dispatch.py",
           "benchmarks/bench_rotary_gpu.py"]

# Peak DRAM bandwidth (GB/s, vendor data sheets) by a substring of torch.cuda.get_device_name(), most specific first.
PEAK_BANDWIDTH_GBPS = [
    ("H200", 4800.0),  # H200 SXM and NVL, HBM3e
    ("H100 NVL", 3900.0),
    ("H100 PCIe", 2000.0),
    ("H100", 3350.0),  # H100 SXM5 ("NVIDIA H100 80GB HBM3")
    ("A100-SXM4-80GB", 2039.0),
    ("A100 80GB PCIe", 1935.0),
    ("A100", 1555.0),  # A100 40 GB, SXM4 and PCIe
]

HEADS, HEAD_DIM, PAIRS, CONV_TAPS = 16, 128, 64, 4


# --------------------------------------------------------------------------------------------------------------------
# GPU helpers (shared with bench_models_gpu.py)
# --------------------------------------------------------------------------------------------------------------------
def require_cuda(script: str) -> None:
    if not torch.cuda.is_available():
        sys.exit(f"{script}: no CUDA device (torch.cuda.is_available() is False; torch {torch.__version__}). "
                 "This benchmark measures the GPU kernels; run it on a machine with an NVIDIA GPU.")


def peak_bandwidth_gbps(device_name: str) -> float | None:
    return next((gbps for key, gbps in PEAK_BANDWIDTH_GBPS if key in device_name), None)


def gpu_info() -> dict:
    props = torch.cuda.get_device_properties(0)
    versions = {}
    for name in ("triton", "fla", "transformers"):
        try:
            versions[name] = __import__(name).__version__
        except (ImportError, AttributeError):
            versions[name] = None
    name = torch.cuda.get_device_name(0)
    return {"gpu": name, "compute_capability": f"{props.major}.{props.minor}",
            "gpu_memory_gib": round(props.total_memory / 2**30, 1), "multiprocessors": props.multi_processor_count,
            "peak_bandwidth_gbps_table": peak_bandwidth_gbps(name), "torch_version": torch.__version__,
            "cuda_version": torch.version.cuda, **{f"{k}_version": v for k, v in versions.items()},
            "python": platform.python_version(), "platform": platform.platform(),
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}


class L2Flush:
    """Overwrites a buffer larger than any L2 cache (H100: 50 MiB) so that timed calls read their inputs from DRAM."""

    def __init__(self, enabled: bool, mib: int = 256):
        self.buffer = torch.empty(mib * 2**20, dtype=torch.uint8, device="cuda") if enabled else None

    def __call__(self) -> None:
        if self.buffer is not None:
            self.buffer.zero_()


def cuda_timings(fns: dict[str, Callable[[], object]], repeats: int, warmup: int = 3,
                 flush: L2Flush | None = None) -> dict:
    """Median (and spread) of CUDA-event times per call for every function; the functions take turns in each round
    (the first one rotates), as in the CPU benchmarks. Returns ``{name: summary}`` in seconds."""
    names = list(fns)
    for _ in range(warmup):
        for name in names:
            fns[name]()
    torch.cuda.synchronize()
    times = {name: [] for name in names}
    for r in range(repeats):
        for name in names[r % len(names):] + names[: r % len(names)]:
            if flush is not None:
                flush()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fns[name]()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) / 1e3)
    return {name: summarize(times[name]) for name in names}


def peak_memory(fn: Callable[[], object]) -> int:
    """Bytes allocated by one call above what was allocated before it (its outputs included)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    result = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del result
    return peak


# --------------------------------------------------------------------------------------------------------------------
# the op's inputs and variants
# --------------------------------------------------------------------------------------------------------------------
def prefill_inputs(batch: int, seq_len: int, dtype: torch.dtype, requires_grad: bool, device: str = "cuda"):
    generator = torch.Generator(device=device).manual_seed(batch * 100003 + seq_len)

    def randn(*shape, dt=torch.float32, scale=1.0):
        return (scale * torch.randn(*shape, device=device, dtype=dt, generator=generator)).requires_grad_(requires_grad)

    q, k = randn(batch, seq_len, HEADS, HEAD_DIM, dt=dtype), randn(batch, seq_len, HEADS, HEAD_DIM, dt=dtype)
    increment = randn(batch, seq_len, HEADS, PAIRS, scale=0.5)
    temperature = (500000.0 ** (-torch.arange(PAIRS, device=device) / PAIRS)).requires_grad_(requires_grad)
    return q, k, increment, temperature, randn(batch, HEADS, PAIRS)


def traffic_bytes(kind: str, batch: int, seq_len: int, dtype: torch.dtype) -> int:
    """Minimal DRAM traffic: each tensor read or written once.

    forward: read q, k and the float32 increments, write q, k. forward + backward: the forward, then read q, k, the
    gradients of q and k and the increments, write dq, dk and d(increment). decode: read and write q, k, the phase and
    the convolution history (float64), read the projection (float64), taps, bias and gate logits (float64).
    """
    size = torch.tensor([], dtype=dtype).element_size()
    qk = batch * seq_len * 2 * HEADS * HEAD_DIM * size  # q and k, once
    increments = batch * seq_len * HEADS * PAIRS * 4
    if kind == "forward":
        return 2 * qk + increments
    if kind == "forward_backward":
        return (2 * qk + increments) + (3 * qk + 2 * increments)
    channels = HEADS * PAIRS
    state = batch * channels * 8 * (1 + (CONV_TAPS - 1))  # phase + history
    return 2 * qk + 2 * state + batch * channels * 8 + channels * CONV_TAPS * 4 + channels * 4 + batch * HEADS * 8


def forward_variants(compile_: bool) -> dict[str, Callable]:
    from selective_rope.kernels.rotary_triton import selective_rotary_triton  # needs triton: imported once checked

    variants = {"torch_eager": selective_rotary}
    if compile_:
        variants["torch_compile"] = torch.compile(selective_rotary, dynamic=False)
    variants["triton"] = selective_rotary_triton
    return variants


def decode_torch(q, k, projection, temperature, phase, history, weight, bias, gate):
    """The model's torch path for one token per row, after the projections (as ``SelectiveRotaryEmbedding``)."""
    batch, heads, pairs = projection.shape
    conv, new_history = causal_conv1d(projection.reshape(batch, 1, -1), weight, history)
    increment = ((conv.view(batch, 1, heads, pairs) + bias.exp()) * torch.sigmoid(gate)[:, None]).float()  # once
    q_out, k_out, new_phase = selective_rotary(q[:, None], k[:, None], increment, temperature, phase)
    return q_out[:, 0], k_out[:, 0], new_phase, new_history


def decode_triton(q, k, projection, temperature, phase, history, weight, bias, gate):
    from selective_rope.kernels.rotary_triton import selective_rotary_decode_triton

    return selective_rotary_decode_triton(q, k, projection, temperature, phase, history, weight, None, bias, gate)


def decode_inputs(batch: int, dtype: torch.dtype, device: str = "cuda"):
    generator = torch.Generator(device=device).manual_seed(batch)

    def randn(*shape, dt=torch.float32):
        return torch.randn(*shape, device=device, dtype=dt, generator=generator)

    # The projection, phase, history and gate logits in float64, as the model passes them (float32 ones would each
    # cost the op a conversion the model never pays); the taps, bias and temperature are float32 parameters.
    f64, channels = torch.float64, HEADS * PAIRS
    return (randn(batch, HEADS, HEAD_DIM, dt=dtype), randn(batch, HEADS, HEAD_DIM, dt=dtype),
            randn(batch, HEADS, PAIRS, dt=f64), 500000.0 ** (-torch.arange(PAIRS, device=device) / PAIRS),
            100 * randn(batch, HEADS, PAIRS, dt=f64), randn(batch, CONV_TAPS - 1, channels, dt=f64),
            randn(channels, CONV_TAPS), 0.1 * randn(HEADS, PAIRS), randn(batch, HEADS, 1, dt=f64))


# --------------------------------------------------------------------------------------------------------------------
# sections
# --------------------------------------------------------------------------------------------------------------------
def result_row(kind: str, batch: int, seq_len: int, dtype, stats: dict, memory: dict, peak_gbps: float | None) -> dict:
    moved = traffic_bytes(kind, batch, seq_len, dtype)
    row = {"batch": batch, "seq_len": seq_len, "traffic_bytes": moved, "variants": {}}
    for name, s in stats.items():
        gbps = moved / s["median_s"] / 1e9
        row["variants"][name] = {**s, "achieved_gbps": round(gbps, 1),
                                 "fraction_of_peak": None if peak_gbps is None else round(gbps / peak_gbps, 3),
                                 "peak_memory_bytes": memory.get(name)}
    fastest_torch = min((s["median_s"] for n, s in stats.items() if n.startswith("torch")), default=None)
    if fastest_torch is not None and "triton" in stats:
        row["triton_speedup_over_best_torch"] = round(fastest_torch / stats["triton"]["median_s"], 2)
    return row


def bench_prefill(kind: str, batches, lengths, dtype, repeats, compile_, flush, peak_gbps) -> list[dict]:
    backward = kind == "forward_backward"
    rows = []
    for batch in batches:
        for seq_len in lengths:
            inputs = prefill_inputs(batch, seq_len, dtype, requires_grad=backward)
            grads = None
            if backward:
                generator = torch.Generator(device="cuda").manual_seed(7)
                grads = [torch.randn(x.shape, device="cuda", dtype=x.dtype, generator=generator)
                         for x in (inputs[0], inputs[1], inputs[4])]
            fns = {}
            for name, op in forward_variants(compile_).items():
                if backward:
                    fns[name] = lambda op=op, x=inputs, g=grads: torch.autograd.grad(op(*x), x, g)
                else:
                    fns[name] = lambda op=op, x=inputs: op(*x)
            with torch.inference_mode(not backward):
                stats = cuda_timings(fns, repeats, flush=flush)
                memory = {name: peak_memory(fn) for name, fn in fns.items()}
            rows.append(result_row(kind, batch, seq_len, dtype, stats, memory, peak_gbps))
            log_row(kind, rows[-1])
            del inputs, grads, fns
            torch.cuda.empty_cache()
    return rows


def bench_decode(batches, dtype, repeats, compile_, flush, peak_gbps) -> list[dict]:
    variants = {"torch_eager": decode_torch}
    if compile_:
        variants["torch_compile"] = torch.compile(decode_torch, dynamic=False)
    variants["triton"] = decode_triton
    rows = []
    for batch in batches:
        inputs = decode_inputs(batch, dtype)
        fns = {name: (lambda op=op, x=inputs: op(*x)) for name, op in variants.items()}
        with torch.inference_mode():
            stats = cuda_timings(fns, repeats, flush=flush)
            memory = {name: peak_memory(fn) for name, fn in fns.items()}
        rows.append(result_row("decode", batch, 1, dtype, stats, memory, peak_gbps))
        log_row("decode", rows[-1])
    return rows


def log_row(kind: str, row: dict) -> None:
    parts = [f"{name} {v['median_s'] * 1e6:9.1f} us {v['achieved_gbps']:7.1f} GB/s"
             + (f" ({100 * v['fraction_of_peak']:4.1f}% peak)" if v["fraction_of_peak"] is not None else "")
             for name, v in row["variants"].items()]
    log(f"  {kind:16s} B={row['batch']:<2d} T={row['seq_len']:<6d} | " + " | ".join(parts))


def print_summary(results: dict) -> None:
    info = results["device"]
    log("=" * 110)
    log(f"Selective RoPE op on {info['gpu']} (peak {results['peak_bandwidth_gbps']} GB/s), {results['plan']['dtype']}, "
        f"H={HEADS}, D={HEAD_DIM}, R={PAIRS}; torch {info['torch_version']}, triton {info['triton_version']}")
    for kind in ("forward", "forward_backward", "decode"):
        log(f"{kind}: median us / achieved GB/s / fraction of peak")
        for row in results[kind]:
            cells = " | ".join(f"{name}: {cell(v)}" for name, v in row["variants"].items())
            speedup = row.get("triton_speedup_over_best_torch")
            log(f"  B={row['batch']:<2d} T={row['seq_len']:<6d} {cells}"
                + (f" | triton {speedup:.2f}x best torch" if speedup else ""))
    log("=" * 110)


def cell(variant: dict) -> str:
    fraction = "-" if variant["fraction_of_peak"] is None else f"{variant['fraction_of_peak']:.2f}"
    return f"{variant['median_s'] * 1e6:8.1f} / {variant['achieved_gbps']:6.0f} / {fraction}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="B=1, T=2048 only, few repeats")
    parser.add_argument("--batches", type=int, nargs="+", default=None, help="batch sizes (default 1 8)")
    parser.add_argument("--lengths", type=int, nargs="+", default=None, help="T (default 2048 8192 32768)")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help=f"JSON path (default {DEFAULT_OUTPUT})")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per variant (default 30, quick 5)")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile variants")
    parser.add_argument("--no-flush-l2", action="store_true", help="do not evict L2 between timed calls")
    parser.add_argument("--peak-gbps", type=float, default=None, help="peak memory bandwidth of this device (GB/s)")
    args = parser.parse_args(argv)
    require_cuda("bench_rotary_gpu.py")
    try:
        import triton  # noqa: F401
    except ImportError:
        sys.exit("bench_rotary_gpu.py: triton is not installed (pip install triton); the Triton kernels cannot run.")

    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)  # one graph per shape
    dtype = getattr(torch, args.dtype)
    batches, lengths = ([1], [2048]) if args.quick else ([1, 8], [2048, 8192, 32768])
    batches, lengths = args.batches or batches, args.lengths or lengths
    repeats = args.repeats or (5 if args.quick else 30)
    info = gpu_info()
    peak_gbps = args.peak_gbps or info["peak_bandwidth_gbps_table"]
    if peak_gbps is None:
        log(f"unknown peak bandwidth for {info['gpu']!r}: pass --peak-gbps to get fractions of peak")
    plan = {"batches": batches, "seq_lens": lengths, "decode_batches": batches,
            "heads": HEADS, "head_dim": HEAD_DIM, "pairs": PAIRS, "conv_taps": CONV_TAPS, "dtype": args.dtype,
            "repeats": repeats, "torch_compile": not args.no_compile, "l2_flush": not args.no_flush_l2}
    results = {"benchmark": "bench_rotary_gpu", "mode": "quick" if args.quick else "full", "device": info,
               "peak_bandwidth_gbps": peak_gbps, "source": source_provenance(REPO_ROOT, SOURCES), "plan": plan,
               "traffic_model": traffic_bytes.__doc__.strip()}
    flush = L2Flush(not args.no_flush_l2)
    start = time.perf_counter()
    compile_ = not args.no_compile
    log(f"[bench_rotary_gpu] {info['gpu']} ({peak_gbps} GB/s peak), {args.dtype}, repeats {repeats}")
    results["forward"] = bench_prefill("forward", batches, lengths, dtype, repeats, compile_, flush, peak_gbps)
    results["forward_backward"] = bench_prefill("forward_backward", batches, lengths, dtype, repeats, compile_, flush,
                                                peak_gbps)
    results["decode"] = bench_decode(plan["decode_batches"], dtype, repeats, compile_, flush, peak_gbps)
    speedups = [row["triton_speedup_over_best_torch"] for kind in ("forward", "forward_backward", "decode")
                for row in results[kind] if "triton_speedup_over_best_torch" in row]
    results["triton_speedup_median"] = round(statistics.median(speedups), 2) if speedups else None
    results["total_wall_s"] = round(time.perf_counter() - start, 1)
    print_summary(results)
    write_results(args.output, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
