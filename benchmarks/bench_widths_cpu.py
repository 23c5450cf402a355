"""Selective RoPE and RoPE over NoPE across widths and lengths on the CPU, and the FoX port over transformers' Llama
(issue 51).

For each family (GLA, Gated DeltaNet, FoX) and hidden size (64, 256, 1024: 1, 4 and 16 heads of 64), four models
built from the same seed take turns round by round: NoPE, RoPE, Selective RoPE and a second NoPE, the noise floor
(its ratio to the first is 1 but for the noise); 2 layers, vocabulary 1024, fp32, the family's registry layout with
short convolutions, SwiGLU width ~8/3 of the hidden size. Measured per width:

* prefill (batch 1, ``use_cache=False``, no grad) at each length;
* cached greedy decoding, ms per token after a context;
* a training step (forward, loss, backward) on a ``batch x length`` batch.

Then, per width, transformers' ``LlamaForCausalLM`` (random, 2 layers, GQA 2:1 where the heads allow) against its
conversions by ``selective_rope.conversion.convert``: the plain port and Selective RoPE FoX (prefill and decoding).

Every figure is the median over rounds; ratios pair the calls of the same round (wall and process CPU time), with
their quartiles; the load average (1 minute) before and after each figure is recorded beside it, since this machine
is shared. The prefill scaling (time at the longest length over time at 1024 tokens, 4x the tokens) is reported per
family and model. ``--before`` adds, for the training step, Selective RoPE with the code before issue 51's changes
(kept in this script only) as a fourth model; ``--torch-path`` adds Selective RoPE on the pure PyTorch path
(``backend="torch"``, the reference: how every training step ran before the compiled training path).

Usage::

    python benchmarks/bench_widths_cpu.py --quick          # a few minutes -> benchmarks/results/widths_cpu.json
    python benchmarks/bench_widths_cpu.py                  # every width and length (long)
    python benchmarks/bench_widths_cpu.py --quick --before --threads 1
    python benchmarks/bench_widths_cpu.py --families gla fox --widths 256 --sections train --before --no-peer \
        --rounds 12 --output /tmp/train_ab.json     # the training step alone, before / after
    python benchmarks/bench_widths_cpu.py --widths 256 --sections train --torch-path --no-peer --rounds 10 \
        --output /tmp/train_compiled.json           # compiled training path against the PyTorch path
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from selective_rope.families import get_family
from selective_rope.modeling import CACHE_FIELD, returned_cache

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUTPUT = ROOT / "benchmarks" / "results" / "widths_cpu.json"
SEED = 0
VOCAB = 1024
LAYERS = 2
FAMILIES = ("gla", "gated_deltanet", "fox")
VARIANTS = ("nope", "rope", "selective_rope")
SECTIONS = ("prefill", "decode", "train", "rotary")
ROTARY_VARIANTS = {"rope": {"position_embedding": "rope"}, "selective_rope": {},  # the rotary module alone
                   "without_gate": {"phase_gate": False}, "without_conv": {"phase_conv_size": 0},
                   "without_gate_and_conv": {"phase_gate": False, "phase_conv_size": 0}}
TARGETS = {"selective_over_nope_at_256": 1.10, "gla_prefill_4x_tokens": 4.4}
PLANS = {
    "quick": {"widths": [64, 256, 1024], "prefill_lengths": {64: [512, 1024, 4096], 256: [512, 1024, 4096],
                                                             1024: [512]},
              "prefill_rounds": 3, "decode_context": 256, "decode_rounds": 3, "decode_steps": 4,
              "train_batch": 16, "train_length": 32, "train_rounds": 3, "peer_lengths": [512, 2048]},
    "full": {"widths": [64, 256, 1024], "prefill_lengths": {64: [512, 1024, 2048, 4096, 8192],
                                                            256: [512, 1024, 2048, 4096, 8192],
                                                            1024: [512, 1024, 2048, 4096, 8192]},
             "prefill_rounds": 5, "decode_context": 512, "decode_rounds": 10, "decode_steps": 8,
             "train_batch": 64, "train_length": 32, "train_rounds": 7, "peer_lengths": [512, 2048, 8192]},
}


# -- timing: interleaved rounds, paired ratios ----------------------------------------------------------------------
def interleaved(fns: dict, rounds: int, calls: int = 1) -> dict:
    """Run every function ``calls`` times per round, the functions taking turns (the first one rotates); one warm-up
    call each. Returns ``{name: {"wall": [...], "cpu": [...]}}`` in seconds per call, plus the load averages."""
    for fn in fns.values():
        fn()
    names, times = list(fns), {name: {"wall": [], "cpu": []} for name in fns}
    load_before = os.getloadavg()[0]
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            for _ in range(calls):
                wall, cpu = time.perf_counter(), time.process_time()
                fns[name]()
                times[name]["wall"].append(time.perf_counter() - wall)
                times[name]["cpu"].append(time.process_time() - cpu)
    return {"times": times, "load_average_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)]}


def spread(values: list[float]) -> dict:
    values = sorted(values)
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else values * 3
    return {"median": round(statistics.median(values), 4), "q1": round(q1, 4), "q3": round(q3, 4)}


def record(measured: dict, base: str, scale: float = 1e3) -> dict:
    """Per model: median wall and CPU ms; for the others, the ratios to ``base`` paired by call (wall and CPU)."""
    times, out = measured["times"], {"load_average_1min": measured["load_average_1min"], "models": {}}
    for name, t in times.items():
        row = {"median_ms": round(statistics.median(t["wall"]) * scale, 3),
               "cpu_median_ms": round(statistics.median(t["cpu"]) * scale, 3)}
        if name != base:
            for key in ("wall", "cpu"):
                row[f"{key}_ratio_to_{base}"] = spread([a / b for a, b in zip(t[key], times[base][key])])
        out["models"][name] = row
    return out


# -- models -----------------------------------------------------------------------------------------------------------
def build(family: str, width: int, position_embedding: str) -> torch.nn.Module:
    spec = get_family(family)
    torch.manual_seed(SEED)  # the same weights for every position embedding, bar the rotary module's
    config = spec.config_class(hidden_size=width, num_hidden_layers=LAYERS, vocab_size=VOCAB,
                               intermediate_size=mlp_width(width), position_embedding=position_embedding,
                               **spec.head_layout(width, max(1, width // 64)))
    return spec.lm_class(config).eval()


def mlp_width(width: int) -> int:
    """The SwiGLU width, ~8/3 of the hidden size rounded up to 32 (as ``selective-rope bench``; FoX's default would
    be Llama-7B's 11008 at every width)."""
    return 32 * -(-8 * width // 96)


def random_ids(batch: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def prefill_fn(model, ids):
    def run():
        with torch.inference_mode():
            model(ids, use_cache=False)
    return run


def decode_fns(models: dict, context: int, steps: int) -> dict:
    """One function per model that decodes ``steps`` greedy tokens after a cached ``context``-token prefill."""
    ids, states = random_ids(1, context, 1000 + context), {}
    with torch.inference_mode():
        for name, model in models.items():
            out = model(ids, use_cache=True)
            states[name] = [returned_cache(out), out.logits[:, -1:].argmax(-1)]

    def make(name):
        def run():
            with torch.inference_mode():
                for _ in range(steps):
                    cache, token = states[name]
                    out = models[name](token, **{CACHE_FIELD: cache}, use_cache=True)
                    states[name] = [returned_cache(out), out.logits[:, -1:].argmax(-1)]
        return run
    return {name: make(name) for name in models}


def train_fn(model, ids):
    def run():
        model.train()
        model(ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)
        model.eval()
    return run


# -- the code before issue 51, for --before (kept here only, never in the package) -------------------------------------
def before_issue_51(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with its rotary modules' L2 normalisation backward as before issue 51 (a fresh tensor per op)."""
    from selective_rope.modeling.rotary import L2NormalizeChunks, SelectiveRotaryEmbedding, phase_dtype

    class L2NormalizeChunksBefore(L2NormalizeChunks):
        @staticmethod
        def backward(ctx, grad, _grad_denom, _grad_unclamped):
            u, denom, unclamped = ctx.saved_tensors
            along = (u * grad).sum(-1, keepdim=True) * unclamped
            return (grad - u * along) / denom

    def normalized_chunks(self, x):
        batch, seq_len, _ = x.shape
        chunks = x.to(phase_dtype(x.device)).view(batch, seq_len, self.num_key_heads, self.chunk_dim)
        if torch.is_grad_enabled() and chunks.requires_grad:
            return L2NormalizeChunksBefore.apply(chunks)[0]
        return torch.nn.functional.normalize(chunks, dim=-1)

    for module in model.modules():
        if isinstance(module, SelectiveRotaryEmbedding) and module.position_embedding == "selective_rope":
            module._normalized_chunks = normalized_chunks.__get__(module)
    return model


# -- sections ---------------------------------------------------------------------------------------------------------
def bench_width(family: str, width: int, plan: dict, before: bool, sections: list[str],
                torch_path: bool = False) -> dict:
    models = {name: build(family, width, name) for name in VARIANTS}
    models["nope_twin"] = build(family, width, "nope")  # the noise floor: a second, identical NoPE model
    result = {"family": family, "hidden_size": width, "config": models["nope"].config.to_diff_dict(),
              "num_parameters": {n: sum(p.numel() for p in m.parameters()) for n, m in models.items() if n in VARIANTS},
              "prefill": [], "scaling": {}}
    for T in plan["prefill_lengths"][width] if "prefill" in sections else []:
        ids = random_ids(1, T, 3000 + T)
        row = record(interleaved({n: prefill_fn(m, ids) for n, m in models.items()}, plan["prefill_rounds"]), "nope")
        result["prefill"].append({"seq_len": T, **row})
        log_row(f"{family} h={width} prefill T={T}", row)
    lengths = [r["seq_len"] for r in result["prefill"]]
    if 1024 in lengths and 4096 in lengths:  # 4x the tokens: 4.0 is linear
        by_len = {r["seq_len"]: r["models"] for r in result["prefill"]}
        for name in VARIANTS:
            result["scaling"][name] = {
                "wall_4096_over_1024": round(by_len[4096][name]["median_ms"] / by_len[1024][name]["median_ms"], 3),
                "cpu_4096_over_1024": round(by_len[4096][name]["cpu_median_ms"] / by_len[1024][name]["cpu_median_ms"],
                                            3)}
        print("  scaling 4096/1024 tokens: " + ", ".join(
            f"{n} {s['wall_4096_over_1024']:.2f} (cpu {s['cpu_4096_over_1024']:.2f})"
            for n, s in result["scaling"].items()), flush=True)

    if "decode" in sections:
        steps = plan["decode_steps"]
        row = record(interleaved(decode_fns(models, plan["decode_context"], steps), plan["decode_rounds"]), "nope",
                     scale=1e3 / steps)
        result["decode"] = {"context": plan["decode_context"], "unit": "ms per token", **row}
        log_row(f"{family} h={width} decode after {plan['decode_context']}", row)
    if "train" in sections:
        result["train"] = bench_train(family, width, models, plan, before, torch_path)
    if "rotary" in sections:
        result["rotary_module_train"] = bench_rotary_module(family, width, models["selective_rope"], plan)
    return result


def bench_rotary_module(family: str, width: int, model: torch.nn.Module, plan: dict) -> dict:
    """The first layer's rotary module alone in training (forward, and forward + backward of q and k against fixed
    upstream gradients), on the training step's batch: RoPE, Selective RoPE and Selective RoPE without its gate
    and/or phase convolution. Where a training step's Selective RoPE time goes, piece by piece."""
    from selective_rope.modeling.rotary import SelectiveRotaryEmbedding

    rotary = next(m for m in model.modules() if isinstance(m, SelectiveRotaryEmbedding))
    spec, config = get_family(family), model.config
    heads, head_dim = rotary.num_key_heads, rotary.rotary_dim  # the registry layouts rotate every dim, no GQA
    generator = torch.Generator().manual_seed(SEED)
    shape = (plan["train_batch"], plan["train_length"])
    x = torch.randn(*shape, width, generator=generator).requires_grad_()
    q = torch.randn(*shape, heads, head_dim, generator=generator).requires_grad_()
    k = torch.randn(*shape, heads, head_dim, generator=generator).requires_grad_()
    upstream = torch.randn_like(q), torch.randn_like(k)
    modules = {}
    for name, options in ROTARY_VARIANTS.items():
        torch.manual_seed(SEED)
        variant = spec.config_class(**{**config.to_dict(), **options})
        modules[name] = SelectiveRotaryEmbedding(variant, heads, heads, head_dim)

    def forward(module):
        return lambda: module(x, q, k, backend="torch")

    def forward_backward(module):
        def run():
            q_out, k_out, _ = module(x, q, k, backend="torch")
            torch.autograd.backward([q_out, k_out], list(upstream))
            x.grad = q.grad = k.grad = None
        return run

    out = {"batch": plan["train_batch"], "seq_len": plan["train_length"], "unit": "ms of process CPU time"}
    for key, make in (("forward", forward), ("forward_backward", forward_backward)):
        measured = interleaved({name: make(m) for name, m in modules.items()}, plan["train_rounds"] * 3)
        out[key] = {name: round(statistics.median(t["cpu"]) * 1e3, 3) for name, t in measured["times"].items()}
        out[key + "_load_average_1min"] = measured["load_average_1min"]
        print(f"  {family} h={width} rotary module {key} (cpu ms): "
              + "  ".join(f"{n} {v:.2f}" for n, v in out[key].items()), flush=True)
    return out


def bench_train(family: str, width: int, models: dict, plan: dict, before: bool, torch_path: bool = False) -> dict:
    train_models = dict(models)
    if before:
        train_models["selective_rope_before"] = before_issue_51(build(family, width, "selective_rope"))
    if torch_path:  # the same weights as "selective_rope", on the pure PyTorch path
        train_models["selective_rope_torch_path"] = build(family, width, "selective_rope")
        train_models["selective_rope_torch_path"].config.backend = "torch"
    ids = random_ids(plan["train_batch"], plan["train_length"], 7)
    row = record(interleaved({n: train_fn(m, ids) for n, m in train_models.items()}, plan["train_rounds"]), "nope")
    log_row(f"{family} h={width} train {plan['train_batch']}x{plan['train_length']}", row)
    return {"batch": plan["train_batch"], "seq_len": plan["train_length"], **row}


def bench_peer(width: int, plan: dict) -> dict:
    """transformers' Llama against its plain port and Selective RoPE FoX conversion, prefill and decoding."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from selective_rope import SelectiveRopeFoXForCausalLM
    from selective_rope.conversion import RetrofitOptions, convert

    heads = max(1, width // 64)
    llama = dict(hidden_size=width, num_hidden_layers=LAYERS, num_attention_heads=heads,
                 num_key_value_heads=max(1, heads // 2), head_dim=64, intermediate_size=mlp_width(width),
                 vocab_size=VOCAB)
    with tempfile.TemporaryDirectory(prefix="bench_widths_llama_") as tmp:
        torch.manual_seed(SEED)
        LlamaForCausalLM(LlamaConfig(**llama, rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
                         ).save_pretrained(Path(tmp) / "llama")
        models = {"llama": LlamaForCausalLM.from_pretrained(Path(tmp) / "llama").eval()}
        for name, options in {"port": RetrofitOptions(selective=False, forget_gate=False),
                              "fox_selective": RetrofitOptions()}.items():
            convert(Path(tmp) / "llama", Path(tmp) / name, options, license="apache-2.0", progress=False)
            models[name] = SelectiveRopeFoXForCausalLM.from_pretrained(Path(tmp) / name).eval()
    result = {"hidden_size": width, "llama_config": llama, "prefill": []}
    for T in plan["peer_lengths"]:
        ids = random_ids(1, T, 3000 + T)
        row = record(interleaved({n: prefill_fn(m, ids) for n, m in models.items()}, plan["prefill_rounds"]), "llama")
        result["prefill"].append({"seq_len": T, **row})
        log_row(f"llama peers h={width} prefill T={T}", row)
    steps = plan["decode_steps"]
    row = record(interleaved(decode_fns(models, plan["decode_context"], steps), plan["decode_rounds"]), "llama",
                 scale=1e3 / steps)
    result["decode"] = {"context": plan["decode_context"], "unit": "ms per token", **row}
    log_row(f"llama peers h={width} decode after {plan['decode_context']}", row)
    return result


def log_row(title: str, row: dict) -> None:
    models = row["models"]
    base = next(name for name, r in models.items() if not any(k.startswith("wall_ratio") for k in r))
    cells = [f"{base} {models[base]['median_ms']:.2f} ms"]
    for name, r in models.items():
        if name != base:
            wall, cpu = r[f"wall_ratio_to_{base}"], r[f"cpu_ratio_to_{base}"]
            cells.append(f"{name} x{wall['median']:.3f} [{wall['q1']:.2f}-{wall['q3']:.2f}] cpu x{cpu['median']:.3f}")
    print(f"  {title}: " + "  ".join(cells) + f"  (load {row['load_average_1min']})", flush=True)


def targets(rows: list[dict]) -> dict:
    """Issue 51's targets: Selective RoPE within 1.10x NoPE at hidden 256 (prefill at every length, training), GLA's
    prefill from 1024 to 4096 tokens within 4.4x (every position embedding)."""
    out = {}
    goal = TARGETS["selective_over_nope_at_256"]
    for row in rows:
        if row["hidden_size"] == 256:
            for p in row["prefill"]:
                value = p["models"]["selective_rope"]["wall_ratio_to_nope"]["median"]
                out[f"{row['family']} selective/nope prefill T={p['seq_len']} h=256"] = met(value, goal)
            if "train" in row:
                value = row["train"]["models"]["selective_rope"]["wall_ratio_to_nope"]["median"]
                out[f"{row['family']} selective/nope train h=256"] = met(value, goal)
            if row["family"] == "gla":
                for name, s in row["scaling"].items():
                    out[f"gla {name} prefill 4096/1024 h=256"] = met(s["wall_4096_over_1024"],
                                                                      TARGETS["gla_prefill_4x_tokens"])
    return out


def met(value: float, goal: float) -> dict:
    return {"value": value, "target": goal, "met": bool(value <= goal)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few minutes: fewer lengths and rounds")
    parser.add_argument("--before", action="store_true", help="also train with the code before issue 51")
    parser.add_argument("--torch-path", action="store_true",
                        help="also train Selective RoPE on the pure PyTorch path (backend='torch')")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1: shared machine)")
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    parser.add_argument("--widths", nargs="+", type=int, default=None, choices=[64, 256, 1024])
    parser.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=SECTIONS,
                        help="what to measure per family and width (default: all)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds of every measurement (default: the plan's)")
    parser.add_argument("--no-peer", action="store_true", help="skip the comparison with transformers' Llama")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help=f"JSON path (default {DEFAULT_OUTPUT})")
    args = parser.parse_args(argv)
    if args.threads < 1:
        parser.error(f"--threads must be at least 1, got {args.threads}")
    if args.rounds is not None and args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")

    plan = dict(PLANS["quick" if args.quick else "full"])
    if args.rounds is not None:
        plan.update(prefill_rounds=args.rounds, decode_rounds=args.rounds, train_rounds=args.rounds)
    widths = args.widths or plan["widths"]
    threads_before = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    try:
        rows = [bench_width(family, width, plan, args.before, args.sections, args.torch_path)
                for family in args.families for width in widths]
        peers = [] if args.no_peer or "fox" not in args.families else [bench_peer(width, plan) for width in widths]
    finally:
        torch.set_num_threads(threads_before)
    results = {
        "benchmark": "bench_widths_cpu", "command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
        "plan": plan, "sections": args.sections, "threads": args.threads, "before_variant": args.before,
        "torch_path_variant": args.torch_path,
        "layers": LAYERS, "vocab_size": VOCAB,
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                    "python": platform.python_version()},
        "git_commit": git_commit(), "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "rows": rows, "peers": peers, "targets": targets(rows), "total_wall_s": round(time.perf_counter() - start, 1)}
    for name, t in results["targets"].items():
        print(f"  target {name}: {t['value']:.3f} <= {t['target']}: {'met' if t['met'] else 'MISSED'}")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {args.output} ({results['total_wall_s']} s)")
    return 0


def git_commit() -> str | None:
    try:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


if __name__ == "__main__":
    sys.exit(main())
