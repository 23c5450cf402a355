"""GPU benchmark of a 370M-class SelectiveRopeGLA: training-step throughput and decoding latency.

The model follows flash-linear-attention's GLA 340M recipe (hidden 1024, 24 layers, 4 heads, expand_k 0.5, expand_v 1,
vocab 32000, MLP ratio 4: about 370M parameters with untied embeddings), with ``position_embedding`` in
{``nope``, ``rope``, ``selective_rope``} (Selective RoPE with its defaults: low-rank projection, 4-tap phase
convolution, per-head gate). For each, and for each backend (``auto``: fla's GLA kernels + our Triton rotary kernels;
``torch``: the pure-PyTorch reference on the GPU):

1. training step: forward + backward + fused AdamW step under bf16 autocast (float32 master weights), batch
   ``--batch-size`` x ``--seq-len`` tokens; tokens/s from the median step time (CUDA events), peak memory;
2. decoding: bf16 weights (the Selective RoPE module kept in float32, as ``from_pretrained(dtype=bfloat16)`` does),
   prefill ``--context`` tokens with the cache, then greedy single-token steps; ms/token from the median step.

Usage::

    python benchmarks/bench_gla_gpu.py             # -> benchmarks/results/gla_gpu.json
    python benchmarks/bench_gla_gpu.py --quick     # 4 layers, short sequences, few steps
    python benchmarks/bench_gla_gpu.py --backends auto

Needs a CUDA GPU; exits with a message otherwise (and falls back, with a warning, to PyTorch kernels where triton
or flash-linear-attention are missing: the JSON records which kernels ran).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from pathlib import Path

import torch
from bench_rotary_gpu import L2Flush, cuda_timings, gpu_info, require_cuda

from selective_rope import SelectiveRopeGLAConfig, SelectiveRopeGLAForCausalLM
from selective_rope.bench.machine import source_provenance
from selective_rope.bench.measure import num_parameters
from selective_rope.bench.report import log, write_results
from selective_rope.kernels import dispatch
from selective_rope.modeling import returned_cache

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"

DEFAULT_OUTPUT = RESULTS_DIR / "gla_gpu.json"
SOURCES = ["kernels/dispatch.py", "kernels/rotary_triton.py", "kernels/gla_torch.py", "modeling/gla.py",
           "configuration/gla.py", "benchmarks/bench_gla_gpu.py", "benchmarks/bench_rotary_gpu.py"]
VARIANTS = ("nope", "rope", "selective_rope")
SEED = 0
MODEL_CONFIG = {  # flash-linear-attention's GLA 340M configuration
    "hidden_size": 1024,
    "num_hidden_layers": 24,
    "num_heads": 4,
    "expand_k": 0.5,
    "expand_v": 1.0,
    "hidden_ratio": 4,
    "vocab_size": 32000,
    "tie_word_embeddings": False,
}


def build_model(position_embedding: str, layers: int) -> SelectiveRopeGLAForCausalLM:
    torch.manual_seed(SEED)
    config = SelectiveRopeGLAConfig(**{**MODEL_CONFIG, "num_hidden_layers": layers},
                                    position_embedding=position_embedding)
    return SelectiveRopeGLAForCausalLM(config).cuda()


def cast_like_from_pretrained(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """``model.to(dtype)`` keeping ``_keep_in_fp32_modules_strict`` (the Selective RoPE module) in float32."""
    keep = set(getattr(model, "_keep_in_fp32_modules_strict", None) or [])
    model.to(dtype)
    for name, param in model.named_parameters():
        if keep & set(name.split(".")):
            param.data = param.data.float()
    return model


def kernels_used(backend: str) -> dict:
    """Which implementation the GLA op and the rotary op resolve to on this machine for ``backend``."""
    rotary = dispatch.resolve_backend(backend, "cuda")
    fla = dispatch.fla_ops(rotary, torch.device("cuda")) is not None
    return {"rotary": rotary, "gla": "fla" if fla else "torch"}


# --------------------------------------------------------------------------------------------------------------------
# 1. training step
# --------------------------------------------------------------------------------------------------------------------
def bench_training(variant: str, backend: str, layers: int, batch: int, seq_len: int, steps: int) -> dict:
    model = build_model(variant, layers).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    generator = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(0, MODEL_CONFIG["vocab_size"], (batch, seq_len), device="cuda", generator=generator)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    torch.cuda.reset_peak_memory_stats()
    stats = cuda_timings({"step": step}, repeats=steps, warmup=3)["step"]
    tokens_per_s = batch * seq_len / stats["median_s"]
    result = {"variant": variant, "backend": backend, "kernels": kernels_used(backend), "batch": batch,
              "seq_len": seq_len, "tokens_per_s": round(tokens_per_s), "peak_memory_gib":
              round(torch.cuda.max_memory_allocated() / 2**30, 2), "num_parameters": num_parameters(model), **stats}
    log(f"  train {variant:15s} {backend:5s}: {stats['median_s'] * 1e3:8.1f} ms/step  {tokens_per_s:10.0f} tokens/s  "
        f"peak {result['peak_memory_gib']:.1f} GiB")
    return result


# --------------------------------------------------------------------------------------------------------------------
# 2. decoding
# --------------------------------------------------------------------------------------------------------------------
@torch.inference_mode()
def bench_decode(variant: str, backend: str, layers: int, batch: int, context: int, steps: int) -> dict:
    model = cast_like_from_pretrained(build_model(variant, layers), torch.bfloat16).eval()
    generator = torch.Generator(device="cuda").manual_seed(2)
    ids = torch.randint(0, MODEL_CONFIG["vocab_size"], (batch, context), device="cuda", generator=generator)
    out = model(ids, use_cache=True)
    state = {"cache": returned_cache(out), "next": out.logits[:, -1:].argmax(-1)}

    def step():
        out = model(state["next"], past_key_values=state["cache"], use_cache=True)
        state["cache"], state["next"] = returned_cache(out), out.logits[:, -1:].argmax(-1)

    stats = cuda_timings({"step": step}, repeats=steps, warmup=5, flush=L2Flush(False))["step"]
    result = {"variant": variant, "backend": backend, "kernels": kernels_used(backend), "batch": batch,
              "context": context, "ms_per_token": round(stats["median_s"] * 1e3, 3), **stats}
    log(f"  decode {variant:15s} {backend:5s} B={batch}: {result['ms_per_token']:7.2f} ms/token")
    return result


def with_ratios(rows: list[dict], key: str) -> list[dict]:
    """Adds ``<key>_vs_nope``, the ratio to the NoPE row of the same backend and batch, to every row."""
    for row in rows:
        base = next((r for r in rows if r["variant"] == "nope" and r["backend"] == row["backend"]
                     and r["batch"] == row["batch"]), None)
        if base is not None:
            row[f"{key}_vs_nope"] = round(row[key] / base[key], 4)
    return rows


def print_summary(results: dict) -> None:
    log("=" * 100)
    cfg = results["model_config"]
    log(f"SelectiveRopeGLA on {results['device']['gpu']}: {cfg['num_parameters']:,} parameters "
        f"({cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']})")
    log(f"training (bf16 autocast, B={results['plan']['batch_size']} x T={results['plan']['seq_len']}):")
    for row in results["training"]:
        log(f"   {row['variant']:15s} {row['backend']:5s} ({row['kernels']['gla']}/{row['kernels']['rotary']}): "
            f"{row['tokens_per_s']:>9,} tokens/s  ({row.get('tokens_per_s_vs_nope', float('nan')):.3f}x NoPE)  "
            f"peak {row['peak_memory_gib']:.1f} GiB")
    log(f"decoding (bf16, context {results['plan']['context']}):")
    for row in results["decode"]:
        log(f"   {row['variant']:15s} {row['backend']:5s} B={row['batch']}: {row['ms_per_token']:7.2f} ms/token  "
            f"({row.get('ms_per_token_vs_nope', float('nan')):.3f}x NoPE)")
    log("=" * 100)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="4 layers, T=512, few steps")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help=f"JSON path (default {DEFAULT_OUTPUT})")
    parser.add_argument("--backends", nargs="+", choices=["auto", "torch"], default=["auto", "torch"])
    parser.add_argument("--batch-size", type=int, default=8, help="training batch (default 8)")
    parser.add_argument("--seq-len", type=int, default=2048, help="training sequence length (default 2048)")
    parser.add_argument("--context", type=int, default=2048, help="decoding: prompt length before the timed steps")
    parser.add_argument("--decode-batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 20 training, 100 decoding)")
    args = parser.parse_args(argv)
    require_cuda("bench_gla_gpu.py")

    layers = 4 if args.quick else MODEL_CONFIG["num_hidden_layers"]
    seq_len, context = (512, 256) if args.quick else (args.seq_len, args.context)
    train_steps = args.steps or (3 if args.quick else 20)
    decode_steps = args.steps or (10 if args.quick else 100)
    plan = {"layers": layers, "batch_size": args.batch_size, "seq_len": seq_len, "context": context,
            "decode_batches": args.decode_batches, "train_steps": train_steps, "decode_steps": decode_steps,
            "backends": args.backends, "variants": list(VARIANTS), "optimizer": "AdamW(fused=True)",
            "training_precision": "bf16 autocast, float32 weights", "decode_precision": "bf16 weights"}
    probe = build_model("selective_rope", layers)
    results = {"benchmark": "bench_gla_gpu", "mode": "quick" if args.quick else "full", "device": gpu_info(),
               "source": source_provenance(REPO_ROOT, SOURCES), "plan": plan,
               "model_config": {**MODEL_CONFIG, "num_hidden_layers": layers, "num_parameters": num_parameters(probe),
                                "full_config": probe.config.to_diff_dict()}}
    del probe
    torch.cuda.empty_cache()

    start = time.perf_counter()
    log(f"[bench_gla_gpu] {results['device']['gpu']}, {results['model_config']['num_parameters']:,} parameters")
    training, decoding = [], []
    for backend in args.backends:
        with backend_override(backend):
            for variant in VARIANTS:
                training.append(bench_training(variant, backend, layers, args.batch_size, seq_len, train_steps))
                torch.cuda.empty_cache()  # the model and optimizer state of the previous variant are gone
            for batch in args.decode_batches:
                for variant in VARIANTS:
                    decoding.append(bench_decode(variant, backend, layers, batch, context, decode_steps))
                    torch.cuda.empty_cache()
    results["training"] = with_ratios(training, "tokens_per_s")
    results["decode"] = with_ratios(decoding, "ms_per_token")
    results["total_wall_s"] = round(time.perf_counter() - start, 1)
    print_summary(results)
    write_results(args.output, results)
    return 0


@contextlib.contextmanager
def backend_override(backend: str):
    """Sets ``SELECTIVE_ROPE_BACKEND`` for the duration (it wins over the config's ``backend``)."""
    previous = os.environ.get(dispatch.ENV_VAR)
    os.environ[dispatch.ENV_VAR] = backend
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(dispatch.ENV_VAR, None)
        else:
            os.environ[dispatch.ENV_VAR] = previous


if __name__ == "__main__":
    sys.exit(main())
