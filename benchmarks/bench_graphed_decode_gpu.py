"""Decoding on CUDA, eager against CUDA-graphed: a 370M FoX (bench_models_gpu.py's shapes, bf16 weights,
the Selective RoPE module in float32) with NoPE and with Selective RoPE.

- eager: the model with its dynamic cache (``SelectiveRopeCache``), one Python forward per token;
- graphed: the one-token step compiled with ``torch.compile(mode="reduce-overhead", fullgraph=True)`` (inductor, then
  CUDA graphs) over a ``SelectiveRopeStaticCache``; the prefill stays eager, as in ``generate``.

Both prefill the same ``--context`` tokens, then take greedy steps in interleaved rounds (``cuda_timings``: eager and
graphed take turns); the whole comparison runs ``--repeats`` times, the variants in turn. ms/token is the median
step (CUDA events around each step). Targets (an H100, batch 1, context 4096): NoPE graphed <= 2 ms/token,
Selective RoPE graphed <= 1.05 x NoPE graphed.

Usage::

    python benchmarks/bench_graphed_decode_gpu.py                  # -> benchmarks/results/graphed_decode_gpu.json
    python benchmarks/bench_graphed_decode_gpu.py --quick          # 2 layers, context 256

Not run yet: written in a session without a GPU.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from bench_models_gpu import build_model, cast_like_from_pretrained, kernels_used
from bench_rotary_gpu import L2Flush, cuda_timings, gpu_info, require_cuda

from selective_rope import SelectiveRopeStaticCache
from selective_rope.modeling import returned_cache

from harness.machine import source_provenance
from harness.report import log, write_results

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUTPUT = REPO_ROOT / "benchmarks" / "results" / "graphed_decode_gpu.json"
SOURCES = ["benchmarks/bench_graphed_decode_gpu.py", "modeling/cache.py", "modeling/base.py", "modeling/fox.py",
           "modeling/rotary.py", "kernels/forgetting_attention_torch.py", "kernels/rotary_triton.py"]
VARIANTS = ("nope", "selective_rope")


def decoders(variant: str, layers: int, batch: int, context: int, steps: int) -> dict:
    """The eager and the graphed step of one model, each from its own prefill of the same prompt."""
    model = cast_like_from_pretrained(build_model("fox", variant, layers), torch.bfloat16).eval()
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (batch, context), device="cuda", generator=torch.Generator("cuda").manual_seed(2))
    graphed = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    # One static cache for every repeat, reset in between: its tensors keep their addresses, so the compiled step and
    # its CUDA graph are reused (a new cache would be new static inputs: a recompilation).
    cache = SelectiveRopeStaticCache(model.config, max_cache_len=context + steps, max_batch_size=batch)
    states = {}

    def prefill():
        cache.reset()
        with torch.no_grad():
            eager_out = model(ids, use_cache=True)
            static_out = model(ids, cache=cache)
        states["eager"] = [returned_cache(eager_out), eager_out.logits[:, -1:].argmax(-1)]
        states["graphed"] = [cache, static_out.logits[:, -1:].argmax(-1)]

    @torch.no_grad()
    def eager_step():
        cache, token = states["eager"]
        out = model(token, cache=cache, use_cache=True)
        states["eager"] = [returned_cache(out), out.logits[:, -1:].argmax(-1)]

    @torch.no_grad()
    def graphed_step():
        cache, token = states["graphed"]
        torch.compiler.cudagraph_mark_step_begin()
        states["graphed"][1] = graphed(token, cache=cache).logits[:, -1:].argmax(-1)

    @torch.no_grad()
    def agreement(steps: int) -> dict:
        """Both paths fed the same random tokens after one prefill: the largest logit difference relative to the
        largest logit, and how often their argmax agrees. (The timed rounds each follow their own greedy tokens, and
        a random model's near-tied logits make those diverge at the first bf16 rounding difference.)"""
        prefill()
        generator = torch.Generator("cuda").manual_seed(3)
        tokens = torch.randint(0, vocab, (batch, steps), device="cuda", generator=generator)
        worst, agree = 0.0, 0.0
        for t in range(steps):
            token = tokens[:, t : t + 1]
            eager_out = model(token, cache=states["eager"][0], use_cache=True)
            states["eager"][0] = returned_cache(eager_out)
            torch.compiler.cudagraph_mark_step_begin()
            graphed_logits = graphed(token, cache=cache).logits.float()  # (read before the next replay overwrites it)
            eager_logits = eager_out.logits.float()
            worst = max(worst, float((graphed_logits - eager_logits).abs().max() / eager_logits.abs().max()))
            agree += float((graphed_logits.argmax(-1) == eager_logits.argmax(-1)).float().mean())
        return {"max_relative_logit_difference": worst, "argmax_agreement": agree / steps, "steps": steps}

    return {"states": states, "prefill": prefill, "eager": eager_step, "graphed": graphed_step,
            "agreement": agreement}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 layers, context 256, few steps")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help=f"JSON path (default {DEFAULT_OUTPUT})")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default 24, quick 2)")
    parser.add_argument("--context", type=int, default=None, help="prompt tokens (default 4096, quick 256)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=None, help="timed steps per repeat (default 50, quick 8)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    require_cuda("bench_graphed_decode_gpu.py")
    layers = args.layers or (2 if args.quick else 24)
    context = args.context or (256 if args.quick else 4096)
    steps = args.steps or (8 if args.quick else 50)
    warmup = 3
    start_all = time.perf_counter()
    results = {"benchmark": "bench_graphed_decode_gpu", "command": " ".join(["python", *sys.argv]),
               "device": gpu_info(), "source": source_provenance(REPO_ROOT, SOURCES), "kernels": kernels_used("auto"),
               "plan": {"family": "fox", "layers": layers, "context": context, "batch": args.batch, "steps": steps,
                        "warmup": warmup, "repeats": args.repeats}, "rows": [], "compile_s": {}}
    runs = {variant: decoders(variant, layers, args.batch, context, warmup + steps + 1) for variant in VARIANTS}
    for repeat in range(args.repeats):
        for variant in (VARIANTS if repeat % 2 == 0 else VARIANTS[::-1]):
            run = runs[variant]
            run["prefill"]()
            if variant not in results["compile_s"]:  # the first graphed step compiles and records the graph
                start = time.perf_counter()
                run["graphed"]()
                torch.cuda.synchronize()
                results["compile_s"][variant] = round(time.perf_counter() - start, 1)
                log(f"{variant}: first graphed step (compile, capture) {results['compile_s'][variant]} s")
                run["prefill"]()
            timings = cuda_timings({"eager": run["eager"], "graphed": run["graphed"]}, repeats=steps, warmup=warmup,
                                   flush=L2Flush(False))
            row = {"repeat": repeat, "variant": variant,
                   **{f"{name}_ms_per_token": round(t["median_s"] * 1e3, 3) for name, t in timings.items()}}
            results["rows"].append(row)
            log(f"repeat {repeat} {variant:15s}: eager {row['eager_ms_per_token']:7.2f} ms/token, graphed "
                f"{row['graphed_ms_per_token']:7.2f} ms/token")
            write_results(args.output, results)  # after every row: a time limit keeps what was measured
    results["agreement"] = {variant: runs[variant]["agreement"](min(steps, 16)) for variant in VARIANTS}
    log(f"eager against graphed, same tokens: {results['agreement']}")
    summary = {variant: {name: statistics.median(row[f"{name}_ms_per_token"] for row in results["rows"]
                                                 if row["variant"] == variant) for name in ("eager", "graphed")}
               for variant in VARIANTS}
    nope, selective = summary["nope"]["graphed"], summary["selective_rope"]["graphed"]
    results.update(summary=summary, targets={
        "nope graphed ms/token <= 2": {"value": nope, "met": nope <= 2.0},
        "selective_rope / nope graphed <= 1.05": {"value": selective / nope, "met": selective / nope <= 1.05}},
        total_wall_s=round(time.perf_counter() - start_all, 1))
    write_results(args.output, results)
    for variant, row in summary.items():
        print(f"{variant:15s}: eager {row['eager']:7.2f} ms/token, graphed {row['graphed']:7.2f} ms/token")
    print(f"targets: {results['targets']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
