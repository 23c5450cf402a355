"""The measurements every family shares, on any ``*ForCausalLM`` of this package (batch 1, float32, inference mode):
prefill throughput (``prefill_rows``), cached decoding after several contexts (``decode_contexts``,
``decode_result``), and the prefill overhead of RoPE and Selective RoPE over NoPE (``position_embedding_overhead``,
``profile_overhead``); interleaved comparisons of several models (``prefill_comparison``, ``decode_comparison``,
``selective_vs_nope``)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from selective_rope.modeling import CACHE_FIELD, returned_cache

from .machine import Quiet
from .report import comparison_cell, log
from .timing import comparison_record, paired_ratio, target, timed_rounds


def random_ids(length: int, vocab_size: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (1, length), generator=generator)


def num_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def decode_contexts(model, contexts: list[int], vocab: int, steps: int, steps_per_round: int,
                    warmup_steps: int, quiet: Quiet) -> dict:
    """Cached greedy decoding after each context: prefill it with ``use_cache=True``, then time single-token steps,
    the contexts taking turns (``steps_per_round`` steps each). Returns ``{"rows": [...], "steps": n}``."""
    caches, next_ids, prefill_s = {}, {}, {}
    with torch.inference_mode():
        for ctx in contexts:
            ids = random_ids(ctx, vocab, seed=1000 + ctx)
            start = time.perf_counter()
            out = model(ids, use_cache=True)
            prefill_s[ctx] = time.perf_counter() - start
            caches[ctx] = returned_cache(out)
            next_ids[ctx] = out.logits[:, -1:].argmax(-1)

        def step(ctx: int) -> None:
            out = model(next_ids[ctx], **{CACHE_FIELD: caches[ctx]}, use_cache=True)
            caches[ctx] = returned_cache(out)
            next_ids[ctx] = out.logits[:, -1:].argmax(-1)  # greedy: each step depends on the previous one

        for _ in range(warmup_steps):
            for ctx in contexts:
                step(ctx)
        stats = timed_rounds({ctx: (lambda c=ctx: step(c)) for ctx in contexts},
                             rounds=-(-steps // steps_per_round), quiet=quiet, calls=steps_per_round, warmup=0)

    rows = []
    for ctx in contexts:
        s = stats[ctx]
        ms = s["median_s"] * 1e3
        rows.append({"context": ctx, "ms_per_token": round(ms, 3), "prefill_s": round(prefill_s[ctx], 4),
                     "cache_seq_length_at_end": caches[ctx].get_seq_length(), **s})
        log(f"  decode context={ctx:5d}: {ms:7.2f} ms/token (median of {s['repeats']}; min {s['min_s'] * 1e3:.2f})")
    return {"steps": rows[0]["repeats"], "rows": rows}


def prefill_rows(model, lengths: list[int], vocab: int, repeats: int, quiet: Quiet, **forward_kwargs) -> list[dict]:
    """Prefill time and tokens/s of ``model`` at each length (batch 1, random ids seeded by the length)."""
    rows = []
    for T in lengths:
        ids = random_ids(T, vocab, seed=T)
        with torch.inference_mode():
            stats = timed_rounds({"prefill": lambda ids=ids: model(ids, **forward_kwargs)}, rounds=repeats,
                                 quiet=quiet)["prefill"]
        tokens_per_s = T / stats["median_s"]
        rows.append({"seq_len": T, "tokens_per_s": round(tokens_per_s, 1), **stats})
        log(f"  prefill T={T:5d}: {stats['median_s'] * 1e3:9.1f} ms  ->  {tokens_per_s:9.0f} tokens/s")
    return rows


def decode_result(decoded: dict, steps_per_round: int, warmup_steps: int, goal: float | None) -> dict:
    """The decode section's record from ``decode_contexts``: the ratio of the last context to the first, a target
    when ``goal`` is given."""
    rows = decoded["rows"]
    ratio = rows[-1]["median_s"] / rows[0]["median_s"]
    result = {"position_embedding": "selective_rope", "steps": decoded["steps"], "steps_per_round": steps_per_round,
              "warmup_steps": warmup_steps, "sampling": "greedy", "rows": rows,
              "ratio_name": f"ms/token at {rows[-1]['context']} / at {rows[0]['context']}"}
    if goal is None:
        result["ratio"] = round(ratio, 4)
    else:
        result["ratio_target"] = target(ratio, goal, higher_is_better=False)
    return result


VARIANTS = ("nope", "rope", "selective_rope")


def position_embedding_overhead(build_model: Callable[[str], torch.nn.Module], T: int, vocab: int, rounds: int,
                                rotary_inputs: Callable[[int], tuple], goal: float, seed: int, quiet: Quiet,
                                **forward_kwargs) -> dict:
    """Prefill time of the same model (same seed) with NoPE, RoPE and Selective RoPE at length ``T``, interleaved,
    and of the first layer's rotary module alone (``rotary_inputs(T)`` gives its ``x, q, k``)."""
    models = {name: build_model(name) for name in VARIANTS}
    params = {name: num_parameters(m) for name, m in models.items()}
    ids = random_ids(T, vocab, seed=2024)
    x, q, k = rotary_inputs(T)
    with torch.inference_mode():
        stats = timed_rounds({name: (lambda m=models[name]: m(ids, **forward_kwargs)) for name in VARIANTS},
                             rounds=rounds, quiet=quiet)
        # the rotary module alone, one layer: what (Selective) RoPE adds to a NoPE layer
        rotary = {name: models[name].model.layers[0].attn.rotary for name in ("rope", "selective_rope")}
        alone = timed_rounds({name: (lambda r=rotary[name]: r(x, q, k)) for name in rotary}, rounds=rounds,
                             quiet=quiet, calls=3, warmup=2)

    base = stats["nope"]["median_s"]
    layers = len(models["nope"].model.layers)
    result = {"seq_len": T, "batch_size": 1, "use_cache": forward_kwargs.get("use_cache", False), "rounds": rounds,
              "interleaved": True, "seed": seed, "num_parameters": params, "timings": stats,
              "rotary_module_alone": alone}
    for name in ("rope", "selective_rope"):
        ratio = stats[name]["median_s"] / base
        result[f"{name}_over_nope"] = target(ratio, goal, higher_is_better=False)
        result[f"{name}_over_nope"]["paired_round_ratio_median"] = round(paired_ratio(stats, name, "nope"), 4)
        result[f"{name}_over_nope"]["min_over_min"] = round(stats[name]["min_s"] / stats["nope"]["min_s"], 4)
        per_layer = alone[name]["median_s"]
        result[f"{name}_rotary_cost"] = {
            "ms_per_layer": round(per_layer * 1e3, 3),
            "ms_all_layers": round(per_layer * layers * 1e3, 3),
            "fraction_of_nope_prefill": round(per_layer * layers / base, 4),
        }
    for name in VARIANTS:
        extra = ""
        if name != "nope":
            extra = (f"  ({result[f'{name}_over_nope']['value']:.3f}x NoPE; rotary module alone "
                     f"{result[f'{name}_rotary_cost']['ms_all_layers']:.1f} ms over {layers} layers)")
        log(f"  prefill T={T} {name:15s}: {stats[name]['median_s'] * 1e3:8.1f} ms{extra}")
    return result


def profile_overhead(build_model: Callable[[str], torch.nn.Module], T: int, vocab: int,
                     rotary_inputs: Callable[[int], tuple], quiet: Quiet, calls: int = 3, top: int = 12,
                     **forward_kwargs) -> dict:
    """Where Selective RoPE's extra prefill time goes: torch.profiler self-CPU time per op, selective_rope minus
    nope (same seed, same input), and the top ops of the rotary module alone."""
    from torch.profiler import ProfilerActivity, profile

    ids = random_ids(T, vocab, seed=2024)
    per_variant = {}
    quiet.wait()
    with torch.inference_mode():
        for name in ("nope", "selective_rope"):
            model = build_model(name)
            model(ids, **forward_kwargs)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(calls):
                    model(ids, **forward_kwargs)
            per_variant[name] = {e.key: (e.self_cpu_time_total / calls / 1e3, e.count // calls)
                                 for e in prof.key_averages()}
        rotary = build_model("selective_rope").model.layers[0].attn.rotary
        x, q, k = rotary_inputs(T)
        rotary(x, q, k)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(calls):
                rotary(x, q, k)
        rotary_ops = sorted(((e.key, e.self_cpu_time_total / calls / 1e3, e.count // calls)
                             for e in prof.key_averages()), key=lambda r: -r[1])[:top]

    sel, nope = per_variant["selective_rope"], per_variant["nope"]
    diff = sorted(((op, sel.get(op, (0, 0))[0] - nope.get(op, (0, 0))[0],
                    sel.get(op, (0, 0))[1] - nope.get(op, (0, 0))[1]) for op in set(sel) | set(nope)),
                  key=lambda r: -r[1])[:top]
    total = {name: sum(ms for ms, _ in ops.values()) for name, ops in per_variant.items()}
    log(f"  profiled self-CPU per forward: nope {total['nope']:.1f} ms, "
        f"selective_rope {total['selective_rope']:.1f} ms")
    log("  extra self-CPU ms per forward (selective_rope - nope), top ops:")
    for op, ms, extra_calls in diff:
        log(f"    {op:32s} {ms:+8.2f} ms  ({extra_calls:+d} calls)")
    log("  rotary module alone (one layer), top self-CPU ops:")
    for op, ms, count in rotary_ops:
        log(f"    {op:32s} {ms:8.3f} ms  ({count} calls)")
    return {"seq_len": T, "calls": calls,
            "self_cpu_ms_per_forward": {name: round(v, 2) for name, v in total.items()},
            "extra_self_cpu_ms_by_op": [{"op": op, "ms": round(ms, 3), "extra_calls": c} for op, ms, c in diff],
            "rotary_module_one_layer_top_ops": [{"op": op, "ms": round(ms, 3), "calls": c}
                                                for op, ms, c in rotary_ops]}


# -- interleaved comparisons of several models (ratios paired by round) ----------------------------------------------
def prefill_comparison(models: dict, lengths: list[int], vocab: int, rounds: int, base: str, quiet: Quiet) -> dict:
    """Prefill time of several models (same input) at each length, interleaved round by round (``use_cache=False``,
    batch 1). Returns ``{"rows": [{"seq_len", "models": comparison_record, "timings": ...}]}``."""
    rows = []
    for T in lengths:
        ids = random_ids(T, vocab, seed=3000 + T)
        with torch.inference_mode():
            stats = timed_rounds({name: (lambda m=m, ids=ids: m(ids, use_cache=False)) for name, m in models.items()},
                                 rounds=rounds, quiet=quiet, min_round_s=0.0)
        record = comparison_record(stats, base)
        rows.append({"seq_len": T, "models": record, "timings": stats})
        log(f"  prefill T={T:5d}: " + "  ".join(comparison_cell(name, r, base) for name, r in record.items()))
    return {"base": base, "rounds": rounds, "interleaved": True, "use_cache": False, "rows": rows}


def decode_comparison(models: dict, contexts: list[int], vocab: int, rounds: int, steps_per_round: int,
                      warmup_steps: int, base: str, quiet: Quiet) -> dict:
    """Cached greedy decoding of several models after each context, interleaved: per round every model decodes
    ``steps_per_round`` tokens in turn. ms per token; ratios pair the steps of the same round."""
    rows = []
    for ctx in contexts:
        ids = random_ids(ctx, vocab, seed=1000 + ctx)
        states = {}
        with torch.inference_mode():
            for name, model in models.items():
                out = model(ids, use_cache=True)
                states[name] = [returned_cache(out), out.logits[:, -1:].argmax(-1)]

            def step(name: str, states: dict = states) -> None:
                cache, token = states[name]
                out = models[name](token, **{CACHE_FIELD: cache}, use_cache=True)
                states[name] = [returned_cache(out), out.logits[:, -1:].argmax(-1)]

            for _ in range(warmup_steps):
                for name in models:
                    step(name)
            stats = timed_rounds({name: (lambda n=name: step(n)) for name in models}, rounds=rounds, quiet=quiet,
                                 calls=steps_per_round, warmup=0, min_round_s=0.0)
        record = comparison_record(stats, base)
        rows.append({"context": ctx, "models": record, "timings": stats})
        log(f"  decode context={ctx:5d} (ms/token): "
            + "  ".join(comparison_cell(name, r, base) for name, r in record.items()))
    return {"base": base, "rounds": rounds, "steps_per_round": steps_per_round, "warmup_steps": warmup_steps,
            "interleaved": True, "sampling": "greedy", "rows": rows}


TARGET_SELECTIVE_OVER_NOPE = 1.10  # Selective RoPE decode and prefill at most 1.10x NoPE (GLA, Gated DeltaNet)
COMPARE_PLANS = {
    "quick": {"compare_decode_contexts": [256, 1024], "compare_decode_rounds": 3, "compare_decode_steps_per_round": 4,
              "compare_prefill_lengths": [512, 1024], "compare_prefill_rounds": 3, "compare_decode_warmup": 2},
    "full": {"compare_decode_contexts": [256, 4096], "compare_decode_rounds": 30, "compare_decode_steps_per_round": 8,
             "compare_prefill_lengths": [2048, 8192], "compare_prefill_rounds": 7, "compare_decode_warmup": 4},
}


def selective_vs_nope(build_model: Callable[[str], torch.nn.Module], vocab: int, plan: dict, quiet: Quiet) -> dict:
    """Decode (ms/token) and prefill of the same model (same seed) with NoPE and with Selective RoPE, interleaved;
    a target of ``TARGET_SELECTIVE_OVER_NOPE`` on every paired-ratio median."""
    models = {"nope": build_model("nope"), "selective_rope": build_model("selective_rope")}
    decode = decode_comparison(models, plan["compare_decode_contexts"], vocab, plan["compare_decode_rounds"],
                               plan["compare_decode_steps_per_round"], plan["compare_decode_warmup"], "nope", quiet)
    prefill = prefill_comparison(models, plan["compare_prefill_lengths"], vocab, plan["compare_prefill_rounds"],
                                 "nope", quiet)
    targets = {}
    for row in decode["rows"]:
        ratio = row["models"]["selective_rope"]["ratio_to_nope"]["median"]
        targets[f"selective_rope / nope decode ms/token at context {row['context']}"] = target(
            ratio, TARGET_SELECTIVE_OVER_NOPE, higher_is_better=False)
    for row in prefill["rows"]:
        ratio = row["models"]["selective_rope"]["ratio_to_nope"]["median"]
        targets[f"selective_rope / nope prefill at T={row['seq_len']}"] = target(
            ratio, TARGET_SELECTIVE_OVER_NOPE, higher_is_better=False)
    return {"num_parameters": {name: num_parameters(m) for name, m in models.items()}, "decode": decode,
            "prefill": prefill, "targets": targets}
