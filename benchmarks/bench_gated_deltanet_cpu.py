"""CPU benchmark of SelectiveRopeGatedDeltaNet and its pure-PyTorch gated delta rule.

Measures, on the CPU, in float32 and under ``torch.inference_mode``:

1. prefill throughput (tokens/s) of a small Gated DeltaNet language model at several sequence lengths;
2. the chunk-parallel gated delta rule op (``chunk_gated_delta_rule``) against transformers' pure-PyTorch
   reference, ``transformers.models.qwen3_next.modeling_qwen3_next.torch_chunk_gated_delta_rule``, on identical
   inputs, forward only (both outputs are also checked against flash-linear-attention's per-token
   ``naive_recurrent_gated_delta_rule``);
3. cached decoding latency (ms/token) after a short and a long context: a recurrent model should not slow
   down with the context length;
4. the prefill overhead of Selective RoPE (and of fixed RoPE) over NoPE for the same model.
5. Selective RoPE against NoPE, decode (ms/token after 256 and 4096 tokens) and prefill (2048 and 8192 tokens),
   interleaved, ratios paired by round (target <= 1.10x each); ``--compare-only`` runs this section alone.

The transformers reference: transformers decorates ``torch_chunk_gated_delta_rule`` so that, when
flash-linear-attention is importable, calling it runs fla's *Triton* ``chunk_gated_delta_rule`` instead (which
cannot run on a CPU). The benchmark calls the undecorated pure-PyTorch function (``inspect.unwrap``) and records
what the decorated name would have dispatched to. Conventions (checked, and the outputs compared): both take
``[B, T, H, D]`` q/k/v, ``g`` = log decay ``[B, T, H]`` (the state is multiplied by ``exp(g)``), ``beta``
``[B, T, H]``, scale ``K^-0.5``, chunk size 64, and compute ``S_t = exp(g_t) (I - β_t k_t k_tᵀ) S_{t-1} +
β_t k_t v_tᵀ``, ``o_t = S_tᵀ q_t · K^-0.5``; q and k are passed L2-normalised, with
``use_qk_l2norm_in_kernel=False`` for the reference.

Timing and load watching are shared with the other benchmarks (the harness ``benchmarks/harness`` runs this
script's spec, ``SPEC``): medians over
interleaved rounds after a warm-up, the script waits for a quiet machine before each section and re-runs rounds
that other processes disturbed; what it saw is recorded under ``contention`` in the JSON.

Usage::

    python benchmarks/bench_gated_deltanet_cpu.py               # full run (a few minutes on a quiet 2-core machine)
    python benchmarks/bench_gated_deltanet_cpu.py --quick       # smoke run
    python benchmarks/bench_gated_deltanet_cpu.py --output benchmarks/results/gated_deltanet_cpu.json
"""

from __future__ import annotations

import inspect
import math
import sys

import torch
import torch.nn.functional as F

from selective_rope.configuration import SelectiveRopeGatedDeltaNetConfig
from selective_rope.kernels.gated_delta_torch import chunk_gated_delta_rule

from harness.machine import Quiet
from harness.report import log
from harness.runner import (
    FamilyBenchmark,
    Run,
    prefill_section,
    print_prefill_section,
    run_benchmark,
    script_paths,
    selective_vs_nope_comparison,
    with_compare_plans,
)
from harness.timing import paired_ratio, target, timed_rounds

# the repository root; benchmarks/results/gated_deltanet_cpu.json, and for --compare-only
# gated_deltanet_selective_vs_nope_cpu.json
PATHS = script_paths(__file__, "gated_deltanet")
SOURCES = ["kernels/gated_delta_torch.py", "modeling/gated_deltanet.py", "configuration/gated_deltanet.py",
           "benchmarks/bench_gated_deltanet_cpu.py"]

SEED = 0
MODEL_CONFIG = {
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_heads": 4,
    "head_dim": 64,
    "expand_v": 1.0,  # value heads of 64 too (fla's default is 2.0)
    "vocab_size": 1024,
    "use_short_conv": True,
}
OP_SHAPE = {"B": 1, "H": 4}

TARGET_OP_SPEED = 1.0  # ours at least as fast as transformers' torch reference, at every measured (T, K)
TARGET_DECODE_RATIO = 1.2  # ms/token at context 4096 at most 1.2x that at context 256
TARGET_ROPE_OVERHEAD = 1.15  # (Selective) RoPE prefill at most 1.15x NoPE prefill


# --------------------------------------------------------------------------------------------------------------------
# inputs
# --------------------------------------------------------------------------------------------------------------------
def delta_inputs(T: int, dim: int, seed: int):
    """q, k (L2-normalised), v, g, beta as the model makes them: ``g = -exp(A_log) softplus(a + dt_bias)`` with
    fla's initialisation (``A ~ U(0, 16)``, ``dt`` log-uniform in [1e-3, 0.1]) and ``a ~ N(0, 1)``, ``β =
    sigmoid(N(0, 1))``."""
    B, H = OP_SHAPE["B"], OP_SHAPE["H"]
    generator = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, dim, generator=generator), dim=-1)
    k = F.normalize(torch.randn(B, T, H, dim, generator=generator), dim=-1)
    v = torch.randn(B, T, H, dim, generator=generator)
    A = torch.empty(H).uniform_(0, 16, generator=generator)
    dt = torch.exp(torch.rand(H, generator=generator) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
    dt_bias = dt + torch.log(-torch.expm1(-dt))
    g = -A * F.softplus(torch.randn(B, T, H, generator=generator) + dt_bias)
    beta = torch.sigmoid(torch.randn(B, T, H, generator=generator))
    return q, k, v, g, beta


def rotary_inputs(T: int):
    cfg = SelectiveRopeGatedDeltaNetConfig(**MODEL_CONFIG)
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(1, T, cfg.hidden_size, generator=generator)
    q = torch.randn(1, T, cfg.num_heads, cfg.head_dim, generator=generator)
    k = torch.randn(1, T, cfg.num_heads, cfg.head_dim, generator=generator)
    return x, q, k


def transformers_reference():
    """transformers' pure-PyTorch chunked gated delta rule, and what its public (decorated) name dispatches to."""
    from transformers.models.qwen3_next import modeling_qwen3_next

    decorated = modeling_qwen3_next.torch_chunk_gated_delta_rule
    reference = inspect.unwrap(decorated)
    dispatch = "the torch function itself"
    try:
        nonlocals = inspect.getclosurevars(decorated).nonlocals
        implementation = nonlocals.get("implementation")
        if implementation is not None and implementation is not reference:
            dispatch = f"{implementation.__module__}.{implementation.__qualname__}"
    except (TypeError, ValueError):
        dispatch = "unknown"
    return reference, {
        "function": f"{reference.__module__}.{reference.__qualname__}",
        "called_as": "inspect.unwrap(torch_chunk_gated_delta_rule), use_qk_l2norm_in_kernel=False",
        "decorated_name_dispatches_to": dispatch,
        "math": "fp32 throughout (inputs cast), cumulative log decay in fp32, torch.linalg.solve_triangular for "
                "the UT transform, a Python loop over chunks",
    }


# --------------------------------------------------------------------------------------------------------------------
# 2. chunk_gated_delta_rule vs transformers' torch_chunk_gated_delta_rule
# --------------------------------------------------------------------------------------------------------------------
def bench_op(lengths: list[int], dims: list[int], rounds: int, oracle_max_len: int, quiet: Quiet) -> dict:
    from fla.ops.gated_delta_rule.naive import (
        naive_recurrent_gated_delta_rule,  # the per-token oracle (slow import)
    )

    reference, reference_info = transformers_reference()

    def ours(q, k, v, g, beta):
        return chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True)

    def theirs(q, k, v, g, beta):
        return reference(q, k, v, g, beta, initial_state=None, output_final_state=True, use_qk_l2norm_in_kernel=False)

    rows = []
    for dim in dims:
        for T in lengths:
            args = delta_inputs(T, dim, seed=T + dim)
            with torch.inference_mode():
                o_ours, s_ours = ours(*args)
                o_theirs, s_theirs = theirs(*args)
                row = {"seq_len": T, "K": dim, "V": dim,
                       "max_abs_diff_output": (o_ours - o_theirs).abs().max().item(),
                       "max_abs_diff_final_state": (s_ours - s_theirs).abs().max().item(),
                       "output_abs_max": o_ours.abs().max().item()}
                if T <= oracle_max_len:
                    q, k, v, g, beta = args
                    o_naive, _ = naive_recurrent_gated_delta_rule(q, k, v, beta, g, output_final_state=True)
                    row["max_abs_err_vs_naive_recurrent"] = {"ours": (o_ours - o_naive).abs().max().item(),
                                                            "transformers": (o_theirs - o_naive).abs().max().item()}
                stats = timed_rounds({"ours": lambda a=args: ours(*a), "transformers": lambda a=args: theirs(*a)},
                                     rounds=rounds, quiet=quiet, warmup=2)
            mine, ref = stats["ours"], stats["transformers"]
            speedup = ref["median_s"] / mine["median_s"]
            row.update({"chunk_gated_delta_rule": mine, "torch_chunk_gated_delta_rule": ref,
                        "speedup": round(speedup, 3), "speedup_min_over_min": round(ref["min_s"] / mine["min_s"], 3),
                        "paired_speedup_median": round(1 / paired_ratio(stats, "ours", "transformers"), 3)})
            rows.append(row)
            log(f"  op K=V={dim:3d} T={T:5d}: ours {mine['median_s'] * 1e3:8.2f} ms | transformers "
                f"{ref['median_s'] * 1e3:8.2f} ms | speed-up {speedup:5.2f}x | max|diff| "
                f"{row['max_abs_diff_output']:.1e}")
    worst = min(rows, key=lambda r: r["speedup"])
    return {"shape": {**OP_SHAPE, "K=V": dims}, "dtype": "float32", "chunk_size": 64, "forward_only": True,
            "output_final_state": True,
            "inputs": "q, k = normalize(randn); v = randn; g = -A softplus(randn + dt_bias) (fla init); "
                      "beta = sigmoid(randn)",
            "reference": reference_info, "rounds": rounds, "interleaved": True, "rows": rows,
            "worst_row": {"seq_len": worst["seq_len"], "K": worst["K"]},
            "speed_target": target(worst["speedup"], TARGET_OP_SPEED, higher_is_better=True)}


# --------------------------------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------------------------------
def print_sections(results: dict) -> None:
    print_prefill_section(results, 1)

    op = results["delta_op"]
    log(f"2. Gated delta rule forward, B={op['shape']['B']} H={op['shape']['H']} fp32: chunk_gated_delta_rule vs "
        f"transformers torch_chunk_gated_delta_rule ({op['rounds']} interleaved rounds)")
    log(f"   {'K=V':>4} | {'T':>6} | {'ours ms':>9} | {'ours min':>9} | {'theirs ms':>9} | {'speed-up':>8} | "
        f"{'max|diff|':>9} | {'vs naive (ours/theirs)':>22}")
    for row in op["rows"]:
        naive = row.get("max_abs_err_vs_naive_recurrent")
        naive_s = f"{naive['ours']:.1e} / {naive['transformers']:.1e}" if naive else "-"
        log(f"   {row['K']:>4} | {row['seq_len']:>6} | {row['chunk_gated_delta_rule']['median_s'] * 1e3:>9.2f} | "
            f"{row['chunk_gated_delta_rule']['min_s'] * 1e3:>9.2f} | "
            f"{row['torch_chunk_gated_delta_rule']['median_s'] * 1e3:>9.2f} | {row['speedup']:>7.2f}x | "
            f"{row['max_abs_diff_output']:>9.1e} | {naive_s:>22}")


# --------------------------------------------------------------------------------------------------------------------
# the spec
# --------------------------------------------------------------------------------------------------------------------
def sections(run: Run) -> list:
    plan = run.plan
    return [("prefill", "1. prefill throughput", lambda: prefill_section(SPEC, run)),
            ("delta_op", "2. chunk_gated_delta_rule vs transformers torch_chunk_gated_delta_rule",
             lambda: bench_op(plan["op_lengths"], plan["op_dims"], plan["op_rounds"], plan["op_oracle_max_len"],
                              run.quiet))]


def targets(results: dict, plan: dict) -> dict:
    worst = results["delta_op"]["worst_row"]
    return {f"op speed-up vs transformers, worst (T={worst['seq_len']}, K={worst['K']})":
            results["delta_op"]["speed_target"]}


SPEC = FamilyBenchmark(
    name="bench_gated_deltanet_cpu", title="Gated DeltaNet CPU benchmark", family="gated_deltanet",
    description=__doc__.split("\n\n")[0], model_config=MODEL_CONFIG, seed=SEED, root=PATHS.root, sources=SOURCES,
    default_output=PATHS.default_output,
    plans=with_compare_plans({
        "quick": {"prefill_lengths": [256, 1024], "prefill_repeats": 3, "op_lengths": [512, 2048], "op_dims": [64],
                  "op_rounds": 3, "op_oracle_max_len": 512, "decode_contexts": [256, 4096], "decode_steps": 8,
                  "decode_steps_per_round": 4, "decode_warmup": 2, "overhead_len": 1024, "overhead_rounds": 3},
        "full": {"prefill_lengths": [256, 1024, 4096], "prefill_repeats": 7, "op_lengths": [512, 2048, 8192],
                 "op_dims": [64, 128], "op_rounds": 9, "op_oracle_max_len": 2048, "decode_contexts": [256, 4096],
                 "decode_steps": 32, "decode_steps_per_round": 8, "decode_warmup": 4, "overhead_len": 2048,
                 "overhead_rounds": 25},
    }),
    sections=sections, print_sections=print_sections, targets=targets, rotary_inputs=rotary_inputs,
    model_details=lambda model: {"num_v_heads": model.config.num_v_heads, "head_v_dim": model.config.head_v_dim,
                                 "conv_size": model.config.conv_size,
                                 "mlp_width": model.model.layers[0].mlp.gate_proj.out_features},
    model_line=lambda cfg: (
        f"model: hidden {cfg['hidden_size']}, layers {cfg['num_hidden_layers']}, heads {cfg['num_heads']}, "
        f"key/value head dims {cfg['head_dim']}/{cfg['head_v_dim']} (expand_v {cfg['expand_v']}), vocab "
        f"{cfg['vocab_size']}, short conv {cfg['use_short_conv']}, {cfg['num_parameters']:,} params, fp32, batch 1"),
    decode_goal=TARGET_DECODE_RATIO, overhead_goal=TARGET_ROPE_OVERHEAD,
    comparison=selective_vs_nope_comparison(PATHS.compare_output),
)


if __name__ == "__main__":
    sys.exit(run_benchmark(SPEC))
