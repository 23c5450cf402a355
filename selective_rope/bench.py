"""``selective-rope bench``: a quick benchmark of randomly initialised models of each family, in float32 under
``torch.inference_mode`` (training: forward + backward): prefill throughput, cached decoding latency and training
throughput, medians of a few timed runs after one warm-up. Configs come from the family registry.

The careful benchmarks (interleaved variants, contention detection, JSON records with provenance) are scripts of the
source repository, not of the installed package: ``python benchmarks/bench_<family>_cpu.py`` (docs/performance.md).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

from .arguments import fail, positive, torch_device
from .families import FAMILY_NAMES, get_family


def cpu_model_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None

def bench_config(family: str, hidden: int, layers: int, vocab: int, position_embedding: str):
    heads = max(1, hidden // 64)
    if hidden % heads or (hidden // heads) % 2:
        raise fail("bench", f"--hidden-size {hidden} must split into {heads} heads of an even size")
    common = dict(hidden_size=hidden, num_hidden_layers=layers, vocab_size=vocab, bos_token_id=1, eos_token_id=2,
                  pad_token_id=0, intermediate_size=32 * -(-8 * hidden // 96), position_embedding=position_embedding)
    spec = get_family(family)
    return spec.config_class(**common, **spec.head_layout(hidden, heads))


def median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_family(family: str, args: argparse.Namespace, device) -> dict:
    import torch

    from .modeling import CACHE_FIELD, returned_cache

    lm_class = get_family(family).lm_class
    torch.manual_seed(0)
    config = bench_config(family, args.hidden_size, args.layers, args.vocab_size, args.position_embedding)
    model = lm_class(config).to(device).eval()
    ids = torch.randint(3, args.vocab_size, (args.batch, args.seq_len), device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def prefill():
        with torch.inference_mode():
            model(ids, use_cache=False)
        sync()

    def decode():  # seconds per decoded token, after a cached prefill (not timed)
        with torch.inference_mode():
            out = model(ids, use_cache=True)
            cache, token = returned_cache(out), out.logits[:, -1:].argmax(-1)
            sync()
            start = time.perf_counter()
            for _ in range(args.decode_tokens):
                out = model(token, **{CACHE_FIELD: cache}, use_cache=True)
                cache, token = returned_cache(out), out.logits[:, -1:].argmax(-1)
            sync()
            return (time.perf_counter() - start) / args.decode_tokens

    def train_step():
        model.train()
        model(ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)
        model.eval()
        sync()

    tokens = args.batch * args.seq_len
    result = {"family": family, "parameters": model.num_parameters(), "config": config.to_diff_dict(),
              "prefill_tokens_per_s": tokens / median_seconds(prefill, args.repeats)}
    decode()  # warm-up
    result["decode_ms_per_token"] = 1e3 * statistics.median(decode() for _ in range(args.repeats))
    if args.train:
        result["train_tokens_per_s"] = tokens / median_seconds(train_step, args.repeats)
    return result


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
run the source repository's scripts: python benchmarks/bench_<family>_cpu.py (their --help describes them).
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
    parser.add_argument("--quick", action="store_true",
                        help="a tiny model and short inputs (hidden size 64, 2 layers, 64 tokens, 8 decoded, 1 run)")
    return parser


def run(args: argparse.Namespace) -> int:
    families = list(FAMILY_NAMES) if args.family == "all" else [args.family]
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
