"""``selective-rope bench``: the quick benchmark of each family (:mod:`.quick`), or ``--full``: the careful
per-family scripts of the source repository (``benchmarks/bench_<family>_cpu.py``, driven by :mod:`.runner`)."""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
from pathlib import Path

from ..arguments import fail, positive, torch_device
from ..families import FAMILY_NAMES
from .machine import cpu_model_name, load_average
from .quick import measure_family

# The full CPU benchmark scripts (bench_<family>_cpu.py) live in the source repository, not in the installed package.
BENCHMARKS_DIR = Path(__file__).resolve().parent.parent / "benchmarks"


def cpu_name() -> str:
    return cpu_model_name() or platform.processor() or platform.machine()


def load_text() -> str:
    load = load_average()
    return " ".join(f"{value:.2f}" for value in load) if load else "n/a"


BENCH_DESCRIPTION = """\
A quick benchmark of randomly initialised models of each family, in float32 under torch.inference_mode (training:
forward + backward): prefill throughput (tokens/s), cached decoding latency (ms/token after a prefill of --seq-len
tokens) and training throughput (tokens/s). Medians over --repeats timed runs after one warm-up run; the machine
(device, threads, torch version) and its load average are printed with the numbers, since other processes on the
machine change them a lot. For careful numbers (interleaved variants, contention detection, JSON with provenance)
use --full, which runs the family's script from the source repository's benchmarks/ folder
(benchmarks/bench_<family>_cpu.py; their --help describes them).
"""


BENCH_DEFAULTS = dict(hidden_size=256, layers=4, seq_len=512, decode_tokens=32, repeats=3)
BENCH_QUICK = dict(hidden_size=64, layers=2, seq_len=64, decode_tokens=8, repeats=1)


def add_parser(commands) -> argparse.ArgumentParser:
    parser = commands.add_parser("bench", help="benchmark prefill, decoding and training speed of each family",
                                 description=BENCH_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=(*FAMILY_NAMES, "all"), default="all", help="model family (default all)")
    parser.add_argument("--hidden-size", type=positive(int), default=None, help="model width (default 256)")
    parser.add_argument("--layers", type=positive(int), default=None, help="number of blocks (default 4)")
    parser.add_argument("--vocab-size", type=positive(int), default=1024, help="vocabulary size (default 1024)")
    parser.add_argument("--position-embedding", choices=("selective_rope", "rope", "nope"), default="selective_rope")
    parser.add_argument("--batch", type=positive(int), default=1, help="batch size (default 1)")
    parser.add_argument("--seq-len", type=positive(int), default=None, help="prompt / training length (default 512)")
    parser.add_argument("--decode-tokens", type=positive(int), default=None,
                        help="tokens decoded one at a time after the prefill (default 32)")
    parser.add_argument("--repeats", type=positive(int), default=None, help="timed runs per measurement (default 3)")
    parser.add_argument("--no-train", dest="train", action="store_false", help="skip the training measurement")
    parser.add_argument("--threads", type=positive(int), default=None, help="torch intra-op threads")
    parser.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    parser.add_argument("--output", type=Path, default=None, help="also write the results as JSON to this path")
    parser.add_argument("--full", action="store_true",
                        help="run benchmarks/bench_<family>_cpu.py from the source repository instead")
    parser.add_argument("--quick", action="store_true",
                        help="with --full: the scripts' short smoke run; otherwise the defaults become a tiny model "
                        "and short inputs (hidden size 64, 2 layers, 64 tokens, 8 decoded, 1 run)")
    parser.add_argument("--compare", action="store_true",
                        help="with --full: only the scripts' interleaved comparisons (--compare-only): FoX against "
                        "transformers' Llama (a random Llama converted as a plain port and as Selective RoPE FoX), "
                        "GLA and Gated DeltaNet with Selective RoPE against NoPE; decode and prefill ratios")
    return parser


def _run_full_benchmarks(families: list[str], quick: bool, compare: bool = False) -> int:
    scripts = [BENCHMARKS_DIR / f"bench_{family}_cpu.py" for family in families]
    missing = [str(script) for script in scripts if not script.exists()]
    if missing:
        raise fail("bench", f"--full needs the source repository's benchmark scripts, not found: {', '.join(missing)} "
                    "(they are not part of the installed package; run without --full for the built-in benchmark)")
    for script in scripts:
        flags = [*(["--quick"] if quick else []), *(["--compare-only"] if compare else [])]
        command = [sys.executable, str(script), *flags]
        print("$ " + " ".join(command), flush=True)
        code = subprocess.run(command, cwd=BENCHMARKS_DIR.parent).returncode
        if code:
            raise fail("bench", f"{script.name} exited with status {code}")
    return 0


def run(args: argparse.Namespace) -> int:
    families = list(FAMILY_NAMES) if args.family == "all" else [args.family]
    if args.compare and not args.full:
        raise fail("bench", "--compare runs the source repository's benchmark scripts: use it with --full")
    if args.full:
        return _run_full_benchmarks(families, args.quick, args.compare)
    defaults = BENCH_QUICK if args.quick else BENCH_DEFAULTS
    for name, value in defaults.items():  # sizes not given on the command line
        if getattr(args, name) is None:
            setattr(args, name, value)
    device = torch_device("bench", args.device)

    import torch

    threads_before = torch.get_num_threads()  # --threads is for this run only: the caller's count comes back
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        return _measure(families, args, device)
    finally:
        torch.set_num_threads(threads_before)


def _measure(families: list[str], args: argparse.Namespace, device) -> int:
    """The measuring part of :func:`run`: every family's row, printed, and the JSON if ``--output`` is given."""
    import torch

    machine = {"device": str(device), "cpu": cpu_name(),
               "threads": torch.get_num_threads(), "torch": torch.__version__, "load_before": load_text()}
    if device.type == "cuda":
        machine["gpu"] = torch.cuda.get_device_name(device)
    print(f"device {machine['device']} ({machine.get('gpu', machine['cpu'])}), {machine['threads']} threads, "
          f"torch {machine['torch']}, float32; load average {machine['load_before']}", flush=True)
    print(f"batch {args.batch} x {args.seq_len} tokens, {args.decode_tokens} decoded tokens, median of "
          f"{args.repeats} runs, position_embedding={args.position_embedding}", flush=True)
    header = f"{'family':<15} {'params':>10} {'prefill tok/s':>14} {'decode ms/tok':>14} {'train tok/s':>12}"
    print(header, flush=True)
    results = []
    for family in families:
        row = measure_family(family, args, device)
        results.append(row)
        train = f"{row['train_tokens_per_s']:12.0f}" if "train_tokens_per_s" in row else f"{'-':>12}"
        print(f"{family:<15} {row['parameters']:>10,} {row['prefill_tokens_per_s']:14.0f} "
              f"{row['decode_ms_per_token']:14.2f} {train}", flush=True)
    machine["load_after"] = load_text()
    print(f"load average after: {machine['load_after']}", flush=True)
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "command"}
        args.output.write_text(json.dumps({"machine": machine, "settings": settings, "results": results}, indent=2))
        print(f"wrote {args.output}", flush=True)
    return 0
