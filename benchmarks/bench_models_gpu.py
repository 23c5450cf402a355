"""GPU benchmark of 370M-class models of each family: training throughput (dense and packed) and decoding latency.

The shapes follow flash-linear-attention's 340M recipes at the paper's scale (hidden 1024, 24 layers, vocab 32000,
MLP ratio 4, untied embeddings; about 370-430M parameters):

- ``gla``: 4 heads, expand_k 0.5, expand_v 1 (fla's GLA 340M);
- ``gated_deltanet``: 4 heads of 256, expand_v 2, short convolutions, output gate (fla's Gated DeltaNet 340M);
- ``fox``: 16 heads of 64, SwiGLU width 2816, forget gate (a Llama-shaped FoX).

Each with ``position_embedding`` in {``nope``, ``rope``, ``selective_rope``} (Selective RoPE with its defaults:
low-rank projection, 4-tap phase convolution, per-head gate), and each backend (``auto``: fla's kernels + our Triton
rotary kernels; ``torch``: the pure-PyTorch reference on the GPU):

1. training step: forward + backward + fused AdamW step under bf16 autocast (float32 master weights), a dense batch
   of ``--batch-size`` x ``--seq-len`` tokens; then (``auto`` only, as the torch ops take no packing) the same number
   of tokens packed into one row of sequences of random lengths (``cu_seqlens``). tokens/s from the median step time
   (CUDA events), peak memory;
2. decoding: bf16 weights (the Selective RoPE module kept in float32, as ``from_pretrained(dtype=bfloat16)`` does),
   prefill ``--context`` tokens with the cache, then greedy single-token steps; ms/token from the median step.

Usage::

    python benchmarks/bench_models_gpu.py                      # all families -> benchmarks/results/models_gpu.json
    python benchmarks/bench_models_gpu.py --families gla --quick
    python benchmarks/bench_models_gpu.py --backends auto --seq-len 4096 --context 4096

fla's autotuned kernels run their saved autotuning choice where Triton's cache holds one (``scripts/gpu_check.sh``
restores the archive of earlier runs) and their first candidate otherwise (``pinned_autotuning.py``; the JSON lists
those kernels under ``first_candidate_kernels``); ``--autotune`` lets them autotune instead (minutes per kernel on a
bare machine). Each family's NoPE rows run again after the other variants (``"repeat": 2``), to show the drift
within the run that the ratios to NoPE are read against.

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
from pinned_autotuning import first_candidates, saved_or_first_configuration

from selective_rope.families import FAMILIES
from selective_rope.kernels import dispatch
from selective_rope.kernels import rotary as rotary_op
from selective_rope.modeling import returned_cache

from harness.machine import source_provenance
from harness.measure import num_parameters
from harness.report import log, write_results

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"

DEFAULT_OUTPUT = RESULTS_DIR / "models_gpu.json"
SOURCES = ["kernels/dispatch.py", "kernels/rotary_triton.py", "kernels/gla.py", "kernels/gated_delta.py",
           "kernels/forgetting_attention.py", "modeling/rotary.py", "modeling/gla.py", "modeling/gated_deltanet.py",
           "modeling/fox.py", "benchmarks/bench_models_gpu.py", "benchmarks/bench_rotary_gpu.py"]
VARIANTS = ("nope", "rope", "selective_rope")
ORDER = (*VARIANTS, "nope")  # NoPE again last: the run's drift
# --unfused: Selective RoPE again with a sequence's phase increments computed by the module's PyTorch ops and then the
# Triton rotary op, instead of the fused op from the input (kernels/rotary.py picks the fused op wherever it serves):
# the two paths side by side in one run. The 28 Nov 2026 H200 module profile had the fused one slower on the device.
UNFUSED = "selective_rope_unfused"
SEED = 0
SHARED_CONFIG = {"hidden_size": 1024, "num_hidden_layers": 24, "vocab_size": 32000, "tie_word_embeddings": False}
MODEL_CONFIGS = {  # flash-linear-attention's 340M recipes; FoX as a Llama of the same width and depth
    "gla": {**SHARED_CONFIG, "num_heads": 4, "expand_k": 0.5, "expand_v": 1.0, "hidden_ratio": 4},
    "gated_deltanet": {**SHARED_CONFIG, "num_heads": 4, "head_dim": 256, "expand_v": 2.0, "use_short_conv": True,
                       "use_gate": True, "hidden_ratio": 4},
    "fox": {**SHARED_CONFIG, "num_attention_heads": 16, "num_key_value_heads": 16, "head_dim": 64,
            "intermediate_size": 2816},
}


def build_model(family: str, position_embedding: str, layers: int) -> torch.nn.Module:
    torch.manual_seed(SEED)
    config = FAMILIES[family].config_class(**{**MODEL_CONFIGS[family], "num_hidden_layers": layers},
                                           position_embedding=position_embedding.removesuffix("_unfused"))
    return FAMILIES[family].lm_class(config).cuda()


def cast_like_from_pretrained(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """``model.to(dtype)`` keeping ``_keep_in_fp32_modules_strict`` (the Selective RoPE module) in float32."""
    keep = set(getattr(model, "_keep_in_fp32_modules_strict", None) or [])
    model.to(dtype)
    for name, param in model.named_parameters():
        if keep & set(name.split(".")):
            param.data = param.data.float()
    return model


def kernels_used(backend: str, family: str | None = None, training: bool = False) -> dict:
    """Which implementation the sequence-mixing op and the rotary op resolve to on this machine for ``backend``."""
    rotary = dispatch.resolve_backend(backend, "cuda")
    fla = dispatch.fla_ops(rotary, torch.device("cuda")) is not None
    if fla and training and family == "gated_deltanet" and dispatch.fla_refuses_gated_delta_backward():
        fla = False  # (kernels/gated_delta.py: fla refuses this backward here, fla issue #640)
    return {"rotary": rotary, "mixer": "fla" if fla else "torch"}


def first_call_seconds(fn, what: str) -> float:
    """Runs ``fn`` once, synchronised, and says how long it took: first calls compile our kernels and autotune
    fla's, which on a bare machine took minutes (the log then shows where the time went)."""
    log(f"  {what}: first call (compiles, autotunes)...")
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    log(f"  {what}: first call {seconds:.1f} s")
    return seconds


def packed_lengths(total: int, mean: int, generator: torch.Generator) -> list[int]:
    """Random sequence lengths in [mean / 2, 3 mean / 2] summing to ``total`` (the last one cut to fit)."""
    lengths = []
    while sum(lengths) < total:
        draw = int(torch.randint(mean // 2, 3 * mean // 2 + 1, (1,), generator=generator))
        lengths.append(min(draw, total - sum(lengths)))
    return lengths


# --------------------------------------------------------------------------------------------------------------------
# 1. training step
# --------------------------------------------------------------------------------------------------------------------
def bench_training(family: str, variant: str, backend: str, layers: int, batch: int, seq_len: int, steps: int,
                   packed: bool = False, repeat: int = 1) -> dict:
    """One row; ``packed``: the ``batch * seq_len`` tokens as one row of random-length sequences (``cu_seqlens``)."""
    model = build_model(family, variant, layers).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    generator = torch.Generator(device="cuda").manual_seed(1)
    vocab = MODEL_CONFIGS[family]["vocab_size"]
    extra = {}
    if packed:
        lengths = packed_lengths(batch * seq_len, seq_len, torch.Generator().manual_seed(3))
        offsets = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        extra = {"cu_seqlens": offsets.cuda()}
        ids = torch.randint(0, vocab, (1, batch * seq_len), device="cuda", generator=generator)
    else:
        ids = torch.randint(0, vocab, (batch, seq_len), device="cuda", generator=generator)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(ids, labels=ids, **extra).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    torch.cuda.reset_peak_memory_stats()
    first_s = first_call_seconds(step, f"train {family} {variant} {backend}{' packed' if packed else ''}")
    stats = cuda_timings({"step": step}, repeats=steps, warmup=2)["step"]
    tokens_per_s = batch * seq_len / stats["median_s"]
    result = {"family": family, "variant": variant, "backend": backend,
              "kernels": kernels_used(backend, family, training=True), "layout": "packed" if packed else "dense",
              "batch": batch, "seq_len": seq_len,
              "tokens_per_s": round(tokens_per_s),
              "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
              "num_parameters": num_parameters(model), "first_step_s": round(first_s, 2), "repeat": repeat, **stats}
    if packed:
        result["num_sequences"] = len(lengths)
    log(f"  train {family:14s} {variant:15s} {backend:5s} {result['layout']:6s}: {stats['median_s'] * 1e3:8.1f} ms/step"
        f"  {tokens_per_s:10.0f} tokens/s  peak {result['peak_memory_gib']:.1f} GiB")
    return result


# --------------------------------------------------------------------------------------------------------------------
# 2. decoding
# --------------------------------------------------------------------------------------------------------------------
@torch.inference_mode()
def bench_decode(family: str, variant: str, backend: str, layers: int, batch: int, context: int, steps: int,
                 repeat: int = 1) -> dict:
    model = cast_like_from_pretrained(build_model(family, variant, layers), torch.bfloat16).eval()
    generator = torch.Generator(device="cuda").manual_seed(2)
    vocab = MODEL_CONFIGS[family]["vocab_size"]
    ids = torch.randint(0, vocab, (batch, context), device="cuda", generator=generator)
    start = time.perf_counter()
    out = model(ids, use_cache=True)
    torch.cuda.synchronize()
    prefill_s = time.perf_counter() - start
    state = {"cache": returned_cache(out), "next": out.logits[:, -1:].argmax(-1)}

    def step():
        out = model(state["next"], past_key_values=state["cache"], use_cache=True)
        state["cache"], state["next"] = returned_cache(out), out.logits[:, -1:].argmax(-1)

    first_s = first_call_seconds(step, f"decode {family} {variant} {backend} B={batch}")
    stats = cuda_timings({"step": step}, repeats=steps, warmup=4, flush=L2Flush(False))["step"]
    result = {"family": family, "variant": variant, "backend": backend, "kernels": kernels_used(backend),
              "batch": batch, "context": context, "ms_per_token": round(stats["median_s"] * 1e3, 3),
              "first_prefill_s": round(prefill_s, 2), "first_step_s": round(first_s, 2), "repeat": repeat, **stats}
    log(f"  decode {family:14s} {variant:15s} {backend:5s} B={batch}: {result['ms_per_token']:7.2f} ms/token")
    return result


def with_ratios(rows: list[dict], key: str) -> list[dict]:
    """Adds ``<key>_vs_nope``, the ratio to the dense NoPE row of the same family, backend and batch, to every row;
    packed rows also get ``<key>_vs_dense``, the ratio to the dense row of the same variant."""
    def match(row, **fixed):
        same = ("family", "backend", "batch")
        return next((r for r in rows if all(r[f] == row[f] for f in same) and r.get("repeat", 1) == 1
                     and all(r.get(f, "dense") == v for f, v in fixed.items())), None)

    for row in rows:
        base = match(row, variant="nope", layout="dense")
        if base is not None:
            row[f"{key}_vs_nope"] = round(row[key] / base[key], 4)
        if row.get("layout") == "packed":
            dense = match(row, variant=row["variant"], layout="dense")
            if dense is not None:
                row[f"{key}_vs_dense"] = round(row[key] / dense[key], 4)
    return rows


def record(results: dict, start: float, output: Path) -> None:
    """Writes the results after every row, so a run cut short (a time limit, fla's autotuning) keeps what it
    measured; the ratios are recomputed over all rows (``with_ratios`` matches within a family)."""
    with_ratios(results["training"], "tokens_per_s")
    with_ratios(results["decode"], "ms_per_token")
    results["total_wall_s"] = round(time.perf_counter() - start, 1)
    results["first_candidate_kernels"] = first_candidates()
    write_results(output, results)


def print_summary(results: dict) -> None:
    log("=" * 100)
    plan = results["plan"]
    for family, cfg in results["model_config"].items():
        log(f"{family} on {results['device']['gpu']}: {cfg['num_parameters']:,} parameters "
            f"({cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']})")
        log(f"  training (bf16 autocast, {plan['batch_size']} x {plan['seq_len']} tokens, dense or packed):")
        for row in (r for r in results["training"] if r["family"] == family):
            vs_dense = f", {row['tokens_per_s_vs_dense']:.3f}x dense" if "tokens_per_s_vs_dense" in row else ""
            log(f"    {row['variant'] + (' (again)' if row.get('repeat', 1) > 1 else ''):15s} {row['backend']:5s} "
                f"{row['layout']:6s} ({row['kernels']['mixer']}/"
                f"{row['kernels']['rotary']}): {row['tokens_per_s']:>9,} tokens/s  "
                f"({row.get('tokens_per_s_vs_nope', float('nan')):.3f}x NoPE{vs_dense})  "
                f"peak {row['peak_memory_gib']:.1f} GiB")
        log(f"  decoding (bf16, context {plan['context']}):")
        for row in (r for r in results["decode"] if r["family"] == family):
            log(f"    {row['variant'] + (' (again)' if row.get('repeat', 1) > 1 else ''):15s} {row['backend']:5s} "
                f"B={row['batch']}: {row['ms_per_token']:7.2f} ms/token  "
                f"({row.get('ms_per_token_vs_nope', float('nan')):.3f}x NoPE)")
    log("=" * 100)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", nargs="+", choices=list(MODEL_CONFIGS), default=list(MODEL_CONFIGS))
    parser.add_argument("--quick", action="store_true", help="4 layers, T=512, few steps")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help=f"JSON path (default {DEFAULT_OUTPUT})")
    parser.add_argument("--backends", nargs="+", choices=["auto", "torch"], default=["auto", "torch"])
    parser.add_argument("--batch-size", type=int, default=8, help="training batch (default 8)")
    parser.add_argument("--seq-len", type=int, default=2048, help="training sequence length (default 2048)")
    parser.add_argument("--context", type=int, default=2048, help="decoding: prompt length before the timed steps")
    parser.add_argument("--decode-batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--train-steps", type=int, default=None, help="timed training steps (default 20, quick 3)")
    parser.add_argument("--decode-steps", type=int, default=None, help="timed decoding steps (default 100, quick 10)")
    parser.add_argument("--no-packed", action="store_true", help="skip the packed training rows")
    parser.add_argument("--unfused", action="store_true",
                        help=f"add {UNFUSED} training rows: Selective RoPE through the module's PyTorch phase ops and "
                             "the rotary op instead of the fused op from the input")
    parser.add_argument("--autotune", action="store_true",
                        help="let fla's kernels autotune where no saved choice exists (default: their first candidate)")
    args = parser.parse_args(argv)
    require_cuda("bench_models_gpu.py")

    layers = 4 if args.quick else SHARED_CONFIG["num_hidden_layers"]
    seq_len, context = (512, 256) if args.quick else (args.seq_len, args.context)
    train_steps = args.train_steps or (3 if args.quick else 20)
    decode_steps = args.decode_steps or (10 if args.quick else 100)
    plan = {"families": args.families, "layers": layers, "batch_size": args.batch_size, "seq_len": seq_len,
            "context": context, "decode_batches": args.decode_batches, "train_steps": train_steps,
            "decode_steps": decode_steps, "backends": args.backends, "variants": list(VARIANTS),
            "packed": not args.no_packed, "optimizer": "AdamW(fused=True)",
            "training_precision": "bf16 autocast, float32 weights", "decode_precision": "bf16 weights",
            "autotuning": "full" if args.autotune else "saved choice or first candidate"}
    results = {"benchmark": "bench_models_gpu", "mode": "quick" if args.quick else "full", "command": sys.argv,
               "device": gpu_info(), "source": source_provenance(REPO_ROOT, SOURCES), "plan": plan,
               "model_config": {}, "training": [], "decode": []}
    start = time.perf_counter()
    with contextlib.nullcontext() if args.autotune else saved_or_first_configuration():
        for family in args.families:
            run_family(family, args, layers, seq_len, context, train_steps, decode_steps, results, start)
    print_summary(results)
    return 0


def run_family(family: str, args, layers: int, seq_len: int, context: int, train_steps: int, decode_steps: int,
               results: dict, start: float) -> None:
    """One family's rows: training (each variant, dense then packed), then decoding, NoPE last again."""
    probe = build_model(family, "selective_rope", layers)
    results["model_config"][family] = {**MODEL_CONFIGS[family], "num_hidden_layers": layers,
                                       "num_parameters": num_parameters(probe),
                                       "full_config": probe.config.to_diff_dict()}
    del probe
    torch.cuda.empty_cache()
    log(f"[bench_models_gpu] {family} on {results['device']['gpu']}, "
        f"{results['model_config'][family]['num_parameters']:,} parameters")
    for backend in args.backends:
        with backend_override(backend):
            if backend == "auto" and family == "gated_deltanet" and dispatch.fla_refuses_gated_delta_backward():
                # Our PyTorch op would train it here (kernels/gated_delta.py), far slower: at 4 x 4096 tokens no
                # timed step ended within a 100 s lease section (28 Nov 2026). `--backends torch` measures that op.
                reason = "fla refuses the gated delta rule's backward here (fla issue #640: Hopper, Triton < 3.7.1)"
                log(f"  train {family} {backend}: skipped, {reason}")
                results.setdefault("skipped", []).append({"family": family, "backend": backend, "rows": "training",
                                                          "reason": reason})
            else:
                train_rows(family, backend, args, layers, seq_len, train_steps, results, start)
            for batch in args.decode_batches:  # (no UNFUSED row: a decoding step never takes the fused op)
                for index, variant in enumerate(ORDER):
                    results["decode"].append(bench_decode(family, variant, backend, layers, batch, context,
                                                          decode_steps, ORDER[:index + 1].count(variant)))
                    record(results, start, args.output)
                    torch.cuda.empty_cache()


def train_rows(family: str, backend: str, args, layers: int, seq_len: int, train_steps: int, results: dict,
               start: float) -> None:
    """The training rows of one family and backend: each variant, dense then packed (``UNFUSED`` after Selective
    RoPE under ``--unfused``)."""
    order = (*VARIANTS, UNFUSED, "nope") if args.unfused else ORDER
    for index, variant in enumerate(order):
        repeat = order[:index + 1].count(variant)
        layouts = [False] + ([True] if backend == "auto" and not args.no_packed else [])
        for packed in layouts:
            with rotary_path(variant):
                results["training"].append(bench_training(family, variant, backend, layers, args.batch_size,
                                                          seq_len, train_steps, packed, repeat))
            record(results, start, args.output)
            torch.cuda.empty_cache()  # the model and optimizer state of the previous row are gone


@contextlib.contextmanager
def rotary_path(variant: str):
    """For ``UNFUSED``, the fused op from the input declines every call (``None``: kernels/rotary.py then takes the
    module's increments and the rotary op); other variants as they are."""
    if variant != UNFUSED:
        yield
        return
    original = rotary_op.sequence_from_input_triton
    rotary_op.sequence_from_input_triton = lambda *args, **kwargs: None
    try:
        yield
    finally:
        rotary_op.sequence_from_input_triton = original


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
