"""How far cached decoding drifts from the full forward over long contexts, and how far bf16 moves the angles.

Three measurements on a 1-layer GLA with trained-looking Selective RoPE parameters (phase increments of order 1, a
phase bias, a gate; ``trained_looking_model``):

1. ``drift``: the logits of a prefill of 16 tokens followed by token-by-token cached decoding, against one full
   forward over the whole sequence (fp32): the max abs difference over the positions up to 1k, 8k, 16k and 32k
   tokens, for each backend (``torch``; ``triton``: our Triton rotary kernels, run by Triton's interpreter on CPU).
2. ``bf16_activations``: the Selective RoPE angles ``τ_i θ_t`` (reduced mod 2π) computed from the mixer input
   rounded to bf16 (what a bf16 model fed the phase path before the bf16 fix; now it gets the norm's float32 output:
   docs/precision.md) against the float32 input: max and median abs angle difference over heads and frequencies at
   each length.
3. ``bf16_temperature``: the angle error if the temperature ``τ`` itself were rounded to bf16 (what
   ``model.to(torch.bfloat16)`` would do without the module's float32 guard): ``θ_t · |τ - bf16(τ)|``.

Run: ``nice -n 19 python benchmarks/phase_precision.py [--lengths 1024 8192 16384 32768] [--backends torch triton]``;
writes ``benchmarks/results/phase_precision.json`` (``--output`` to change it). The committed file combines a run of
the version with a float32 phase with a run of this one. At 32k tokens the Triton interpreter takes ~15 min
of CPU for the decoding loop (a kernel launch per token).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: the kernels run on CPU

import torch  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from selective_rope import SelectiveRopeGLAConfig, SelectiveRopeGLAForCausalLM  # noqa: E402
from selective_rope.modeling import returned_cache  # noqa: E402

PREFILL = 16


def trained_looking_model(seed: int = 0) -> SelectiveRopeGLAForCausalLM:
    """1-layer GLA whose phase parameters look trained: projections giving O(1) increments, a phase bias around 0
    (``exp(b)`` ~ 1 per token), a gate bias that leaves the gate mostly open, non-trivial norms."""
    torch.manual_seed(seed)
    config = SelectiveRopeGLAConfig(vocab_size=61, hidden_size=32, num_hidden_layers=1, num_heads=2, num_kv_heads=2,
                                    expand_k=1.0, expand_v=1.0, intermediate_size=48, phase_bias=True,
                                    initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = SelectiveRopeGLAForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(0.2 * torch.randn_like(param))
            elif name.endswith("rotary.phase_bias"):
                param.copy_(0.3 * torch.randn_like(param))
            elif name.endswith("phase_gate_proj.bias"):
                param.fill_(1.0)
    return model


def tokens(length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 61, (1, length), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def drift(model, length: int, checkpoints: list[int]) -> dict:
    ids = tokens(length)
    start = time.perf_counter()
    full = model(ids, use_cache=False).logits[0]  # (T, V)
    out = model(ids[:, :PREFILL], use_cache=True)
    steps, cache = [out.logits[0]], returned_cache(out)
    for t in range(PREFILL, length):
        out = model(ids[:, t:t + 1], past_key_values=cache, use_cache=True)
        steps.append(out.logits[0])
    cached = torch.cat(steps)
    error = (cached - full).abs().amax(dim=-1)  # (T,)
    agree = (cached.argmax(-1) == full.argmax(-1)).float()
    return {
        "max_abs_logit_diff": {str(n): float(error[:n].max()) for n in checkpoints},
        "greedy_disagreement": {str(n): float(1 - agree[:n].mean()) for n in checkpoints},
        "phase_dtype": str(cache.layers[0].states["rotary.phase"].dtype),
        "wall_s": round(time.perf_counter() - start, 1),
    }


def reduced_angles(phase: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """``τ θ`` reduced to ``(-π, π]`` in float64: ``(B, T, Hk, R)``."""
    angle = phase.double() * temperature.double()
    return torch.remainder(angle + math.pi, 2 * math.pi) - math.pi


def angle_difference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.remainder(a - b + math.pi, 2 * math.pi) - math.pi


@torch.no_grad()
def bf16_effects(model, length: int, checkpoints: list[int]) -> tuple[dict, dict]:
    """Angles from a float32 vs a bf16-rounded mixer input, and from a bf16-rounded temperature."""
    block = model.model.layers[0]
    rotary = block.attn.rotary
    x = block.attn_norm(model.model.embeddings(tokens(length)))  # the mixer input (1, T, D)
    temperature = rotary.temperature.detach()

    def phases(inputs):
        increment, _ = rotary.phase_increment(inputs, None, None, None)
        return torch.cumsum(increment.double(), dim=1)  # float64: only the input differs

    exact = phases(x)
    rounded = phases(x.bfloat16())
    activations = angle_difference(reduced_angles(rounded, temperature), reduced_angles(exact, temperature)).abs()
    temperature_error = (temperature.bfloat16().double() - temperature.double()).abs()
    tau_rounding = exact.abs() * temperature_error  # (1, T, Hk, R)

    def summary(error):
        return {str(n): {"max": float(error[:, :n].max()), "median": float(error[:, n - 1].median())}
                for n in checkpoints}

    return summary(activations), summary(tau_rounding)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 8192, 16384, 32768])
    parser.add_argument("--backends", nargs="+", default=["torch", "triton"], choices=["torch", "triton"])
    parser.add_argument("--output", type=Path, default=REPO_ROOT / "benchmarks" / "results" / "phase_precision.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    length, checkpoints = max(args.lengths), sorted(args.lengths)
    results = {"benchmark": "phase_precision", "lengths": checkpoints, "prefill": PREFILL, "drift": {}}
    for backend in args.backends:
        model = trained_looking_model()
        model.config.backend = backend
        for module in model.modules():
            if hasattr(module, "backend"):
                module.backend = backend
        results["drift"][backend] = drift(model, length, checkpoints)
        print(backend, json.dumps(results["drift"][backend]), flush=True)
    results["bf16_activations_angle_error_rad"], results["bf16_temperature_angle_error_rad"] = bf16_effects(
        trained_looking_model(), length, checkpoints)
    print(json.dumps({k: results[k] for k in ("bf16_activations_angle_error_rad",
                                              "bf16_temperature_angle_error_rad")}))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
