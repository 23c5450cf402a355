"""How long ``torch.compile`` takes for a toy model on the CPU: the first compiled training step (forward + backward:
tracing, inductor code generation and the C++ builds) against an eager step, and the graph breaks dynamo reported.

    python benchmarks/compile_time_cpu.py                  # -> benchmarks/results/compile_time_cpu.json
    python benchmarks/compile_time_cpu.py --family fox --threads 1

The model is the demo's (``selective_rope.demo.demo_config``: 2 layers, hidden 64). Inductor's caches are off and
its kernels go to a fresh folder, so the time is a cold compile (a warm cache serves a rerun in seconds). Other
processes change the figure a lot: the load average before and after is recorded with it.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="gla", help="model family (default gla)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results" / "compile_time_cpu.json")
    args = parser.parse_args(argv)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-")
    os.environ["TORCHINDUCTOR_FX_GRAPH_CACHE"] = "0"
    os.environ["TORCHINDUCTOR_AUTOGRAD_CACHE"] = "0"

    import torch
    from torch._dynamo.utils import counters
    from transformers import AutoModelForCausalLM

    from selective_rope.demo import demo_config, progressions

    from harness.machine import device_info, load_average, source_provenance
    from harness.report import log, write_results

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    model = AutoModelForCausalLM.from_config(demo_config(args.family)).train()
    ids = progressions(32, 24, generator)

    def step(fn) -> float:
        start = time.perf_counter()
        fn(ids, labels=ids).loss.backward()
        return time.perf_counter() - start

    device = device_info(torch.get_num_threads())  # the machine (and its date) when the run starts
    load_before = load_average()
    eager = min(step(model) for _ in range(3))
    compiled = torch.compile(model)
    first = step(compiled)
    second = step(compiled)
    breaks = {reason: count for reason, count in counters["graph_break"].items()}
    results = {"benchmark": "compile_time_cpu", "command": " ".join(["python", *sys.argv]),
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "family": args.family,
               "device": device, "source": source_provenance(ROOT, []),
               "load_average_before": load_before, "load_average_after": load_average(),
               "eager_step_s": round(eager, 4), "first_compiled_step_s": round(first, 1),
               "second_compiled_step_s": round(second, 4), "graph_breaks": breaks}
    log(f"{args.family}: eager step {eager * 1e3:.0f} ms; first compiled step (cold compile) {first:.1f} s; "
        f"second {second * 1e3:.0f} ms; load average {load_before} -> {results['load_average_after']}; "
        f"graph breaks: {breaks or 'none'}")
    write_results(args.output, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
