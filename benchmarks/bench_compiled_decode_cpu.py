"""Compiled decoding with the static cache against eager decoding with the dynamic cache, on the CPU.

For each family (GLA, Gated DeltaNet, FoX; Selective RoPE, fp32) and batch size (1 and 8): a prompt of ``context``
tokens is prefilled eagerly into each cache, then greedy one-token steps run in interleaved rounds, the eager model
with its ``SelectiveRopeCache`` and the ``torch.compile``'d step (inductor, ``fullgraph=True``) with its
``SelectiveRopeStaticCache`` taking turns, so both see the same machine load. Only the step is compiled (the prefill
stays eager, as in ``generate``); the compile time is the first compiled step's wall time, with inductor's caches
off and its kernels built in a fresh folder (a warm cache would serve a rerun's kernels in seconds). ms/token is the
wall time of one step (one token for every row of the batch), median over the measured steps.

Compiling is slow on a small loaded CPU (inductor builds C++ for every graph: minutes per family and batch size);
``--backend aot_eager`` measures the capture alone (no code generation, and no speed-up expected from it).

Usage::

    python benchmarks/bench_compiled_decode_cpu.py            # -> benchmarks/results/compiled_decode_cpu.json
    python benchmarks/bench_compiled_decode_cpu.py --quick    # smoke run (tiny model, few steps)
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from selective_rope import SelectiveRopeStaticCache
from selective_rope.families import FAMILIES as REGISTRY
from selective_rope.modeling import returned_cache

from harness.measure import num_parameters
from harness.report import log, write_results
from harness.runner import configure, start_results

ROOT = Path(__file__).resolve().parents[1]  # the repository
DEFAULT_OUTPUT = ROOT / "benchmarks" / "results" / "compiled_decode_cpu.json"
SOURCES = ["benchmarks/bench_compiled_decode_cpu.py", "modeling/cache.py", "modeling/base.py", "modeling/fox.py",
           "kernels/forgetting_attention_torch.py"]
SEED = 0
CONFIGS = {  # per family: the full run's model (2 layers, hidden 256) and the quick run's
    "gla": {"num_heads": 4, "use_short_conv": True},
    "gated_deltanet": {"num_heads": 4, "head_dim": 64, "expand_v": 1.0, "use_short_conv": True},
    "fox": {"num_attention_heads": 4, "num_key_value_heads": 4},  # + an MLP 4x as wide, as GLA's and GDN's
}
PLANS = {
    "quick": {"hidden_size": 32, "num_hidden_layers": 1, "vocab_size": 64, "context": 8, "batches": [1, 2],
              "rounds": 2, "steps_per_round": 2, "warmup": 1},
    "full": {"hidden_size": 256, "num_hidden_layers": 2, "vocab_size": 1024, "context": 128, "batches": [1, 8],
             "rounds": 10, "steps_per_round": 4, "warmup": 2},
}


def build(family: str, plan: dict) -> torch.nn.Module:
    spec = REGISTRY[family]
    torch.manual_seed(SEED)
    mlp = {"intermediate_size": 4 * plan["hidden_size"]} if family == "fox" else {}  # (its default is Llama's 11008)
    config = spec.config_class(hidden_size=plan["hidden_size"], num_hidden_layers=plan["num_hidden_layers"],
                               vocab_size=plan["vocab_size"], **CONFIGS[family], **mlp)
    return spec.lm_class(config).eval()


@torch.no_grad()
def compare(model, batch: int, plan: dict, backend: str) -> dict:
    """Interleaved rounds of eager dynamic-cache steps and compiled static-cache steps from the same prompt."""
    generator = torch.Generator().manual_seed(SEED)
    prompt = torch.randint(3, plan["vocab_size"], (batch, plan["context"]), generator=generator)
    steps = plan["warmup"] + plan["rounds"] * plan["steps_per_round"]
    dynamic = model(prompt, use_cache=True)
    static_cache = SelectiveRopeStaticCache(model.config, max_cache_len=plan["context"] + steps + 1,
                                            max_batch_size=batch)
    static = model(prompt, cache=static_cache)
    step = torch.compile(model, backend=backend, fullgraph=True, dynamic=False)  # the step only: prefill was eager
    tokens = {"eager": dynamic.logits[:, -1:].argmax(-1), "compiled": static.logits[:, -1:].argmax(-1)}
    caches = {"eager": returned_cache(dynamic), "compiled": static_cache}
    calls = {"eager": lambda ids, cache: model(ids, cache=cache, use_cache=True),
             "compiled": lambda ids, cache: step(ids, cache=cache)}

    def run(name: str) -> float:
        start = time.perf_counter()
        logits = calls[name](tokens[name], caches[name]).logits
        tokens[name] = logits[:, -1:].argmax(-1)
        return time.perf_counter() - start

    start = time.perf_counter()
    run("compiled")
    compile_s = time.perf_counter() - start
    run("eager")  # (both decoders then stay at the same token)
    times = {"eager": [], "compiled": []}
    for _ in range(plan["warmup"]):
        run("eager")
        run("compiled")
    for _ in range(plan["rounds"]):
        for name in ("eager", "compiled"):
            times[name] += [run(name) for _ in range(plan["steps_per_round"])]
    same = torch.equal(tokens["eager"], tokens["compiled"])  # the last greedy tokens (of a random model: near-ties)
    return {"batch": batch, "compile_s": compile_s, "same_last_tokens": same,
            **{f"{name}_ms_per_token": 1e3 * statistics.median(values) for name, values in times.items()},
            "speedup": statistics.median(times["eager"]) / statistics.median(times["compiled"])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run (tiny model, few steps)")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help=f"JSON path (default {DEFAULT_OUTPUT})")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: usable cores)")
    parser.add_argument("--max-wait", type=float, default=None, help="seconds in all to wait for a quiet machine")
    parser.add_argument("--max-redo", type=int, default=None, help="(unused here; accepted as by every benchmark)")
    parser.add_argument("--families", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--backend", default="inductor", choices=["inductor", "aot_eager", "eager"],
                        help="torch.compile backend of the step (default inductor)")
    args = parser.parse_args(argv)
    # Compile times from scratch: inductor's caches would serve a rerun's graphs and kernels in seconds. Its kernel
    # libraries go to a folder of this run's own, removed at the end (the first row also builds the precompiled
    # header there).
    torch._inductor.config.force_disable_caches = True
    scratch = tempfile.mkdtemp(prefix="bench-compiled-decode-inductor-")
    previous_cache_dir = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = scratch

    threads_before = torch.get_num_threads()
    try:
        threads, quiet = configure(args, SEED)
        plan = PLANS["quick" if args.quick else "full"]
        results = start_results("bench_compiled_decode_cpu", args, threads, ROOT, SOURCES,
                                {**plan, "compile_backend": args.backend})
        start = time.perf_counter()
        rows = []
        for family in args.families:
            model = build(family, plan)
            log(f"{family}: {num_parameters(model):,} parameters")
            for batch in plan["batches"]:
                quiet.wait()
                load_before = os.getloadavg()
                torch._dynamo.reset()  # each (family, batch) pays its own compilation
                row = {"family": family, **compare(model, batch, plan, args.backend),
                       "load_average_before": load_before, "load_average_after": os.getloadavg()}
                log(f"  batch {batch}: eager {row['eager_ms_per_token']:.2f} ms/token, compiled "
                    f"{row['compiled_ms_per_token']:.2f} ms/token (compile {row['compile_s']:.0f} s)")
                rows.append(row)
                # after every row: a run stopped by a time limit keeps what it measured
                write_results(args.output, {**results, "rows": rows, "complete": False})
        results.update(rows=rows, complete=True, contention={"quiet": quiet.summary()},
                       total_wall_s=time.perf_counter() - start)
        print_table(rows)
        write_results(args.output, results)
    finally:
        torch.set_num_threads(threads_before)
        if previous_cache_dir is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = previous_cache_dir
        shutil.rmtree(scratch, ignore_errors=True)  # the folder made above, and only it
    return 0


def print_table(rows: list[dict]) -> None:
    print(f"{'family':>15} | {'batch':>5} | {'eager dynamic ms/tok':>20} | {'compiled static ms/tok':>22} | "
          f"{'speed-up':>8} | {'compile s':>9}")
    for row in rows:
        print(f"{row['family']:>15} | {row['batch']:>5} | {row['eager_ms_per_token']:>20.2f} | "
              f"{row['compiled_ms_per_token']:>22.2f} | {row['speedup']:>8.2f} | {row['compile_s']:>9.1f}")


if __name__ == "__main__":
    sys.exit(main())
