"""bf16 against fp32: full-forward logits of the same model in both dtypes, per family and length, and where the
difference comes from.

Each family's tiny random model (``CONFIGS``: hidden 64, 2 layers, 4 heads, vocabulary 256, ``initializer_range``
0.2 so that the logits are of order 1; GLA 136k parameters, Gated DeltaNet 133k, FoX 113k) is built in float32 with
every weight rounded to a bf16 value, so that ``model.to(torch.bfloat16)`` holds exactly the same weights: the
difference measured is the computation's, not the weights' rounding. Both dtypes run one full forward
(``use_cache=False``, the CPU's default backend) over the same random tokens at each length; reported per length: the
max and mean abs difference of the logits over all positions, the argmax agreement, and the same over the last 1024
positions only (``last_window``: whether the difference grows along the sequence).

``--ablations`` (at one length, ``--ablation-length``; backend ``"torch"``): the bf16 model again with one part
computed as the float32 model computes it, so that the drop in the difference shows that part's share (the float32
model is the reference throughout):

- ``phase_input_rounded``: the Selective RoPE phase path reads the mixer input rounded to bf16 (what it read before
  the bf16 fix; now it reads the block norm's float32 output);
- ``phase_exact``: the phase increments replaced by the float32 model's (the phase path as if it had the float32
  model's inputs);
- ``gates_fp32``: the decay / forget-gate projections (GLA ``gk_proj``, Gated DeltaNet ``a_proj``/``b_proj``, FoX
  ``f_proj``) in float32;
- ``mixer_fp32``: the whole mixer (projections, rotation, recurrence or attention, output norm) in float32 on the
  bf16 input, its output rounded to bf16;
- ``mlp_fp32``: every MLP in float32; ``head_fp32``: the final norm and the LM head in float32.

``--speed`` (instead of the above): what the fix costs, the decoder block as it was before the bf16 fix (the norm in the
model dtype, the phase path reading its rounded output) against now, interleaved in one process (order alternating):
a 2-layer GLA of hidden 256 (vocabulary 1024), one thread, float32 and bf16: a 1024-token forward, single-token cached
steps, a 512-token forward and backward; medians. Written to ``bf16_precision_speed.json``.

Run: ``nice -n 19 python benchmarks/bf16_precision.py [--lengths 2048 8192 32768] [--ablations]``; writes
``benchmarks/results/bf16_precision.json`` (``--output`` to change it). On the shared 2-core machine a run with
``--ablations`` took ~6 min, ``--speed`` ~4 min. docs/precision.md reads the results.
"""

from __future__ import annotations

import argparse
import copy
import inspect
import statistics
import time
from pathlib import Path

import torch
from torch import nn

from selective_rope import FAMILIES
from selective_rope.modeling import returned_cache
from selective_rope.modeling.base import SelectiveRopeDecoderBlock

from harness.measure import num_parameters
from harness.report import log, write_results
from harness.runner import start_results

ROOT = Path(__file__).resolve().parents[1]  # the repository
DEFAULT_OUTPUT = ROOT / "benchmarks" / "results" / "bf16_precision.json"
SOURCES = ["benchmarks/bf16_precision.py", "modeling/base.py", "modeling/gla.py", "modeling/gated_deltanet.py",
           "modeling/fox.py", "kernels/gla_torch.py", "kernels/gated_delta_torch.py",
           "kernels/forgetting_attention_torch.py"]
VOCAB = 256
TOKENS = dict(vocab_size=VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2, initializer_range=0.2)
CONFIGS = {
    "gla": dict(**TOKENS, hidden_size=64, num_hidden_layers=2, num_heads=4, expand_k=1.0, expand_v=1.0,
                use_short_conv=True, intermediate_size=128),
    "gated_deltanet": dict(**TOKENS, hidden_size=64, num_hidden_layers=2, num_heads=4, head_dim=16, expand_v=1.0,
                           use_short_conv=True, intermediate_size=128),
    "fox": dict(**TOKENS, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, intermediate_size=128),
}
LAST_WINDOW = 1024
GATES = ("gk_proj", "a_proj", "b_proj", "f_proj")


def build(family: str, backend: str = "auto", seed: int = 0) -> nn.Module:
    """The family's float32 model with every weight rounded to a bf16 value (``.to(torch.bfloat16)`` keeps them)."""
    spec = FAMILIES[family]
    torch.manual_seed(seed)
    model = spec.lm_class(spec.config_class(**CONFIGS[family], backend=backend)).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(param.bfloat16())
    return model


def tokens(length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def logits(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, float]:
    """``(T, V)`` float32 logits of one full forward, and its wall time."""
    start = time.perf_counter()
    out = model(ids, use_cache=False).logits[0].float()
    return out, time.perf_counter() - start


def compare(reference: torch.Tensor, other: torch.Tensor) -> dict:
    """Max / mean abs difference and argmax agreement, over all positions and over the last ``LAST_WINDOW``."""
    diff = (other - reference).abs()  # (T, V)
    agree = (other.argmax(-1) == reference.argmax(-1)).float()  # (T,)

    def stats(rows: slice) -> dict:
        return {"max_abs": float(diff[rows].max()), "mean_abs": float(diff[rows].mean()),
                "argmax_agreement": float(agree[rows].mean())}

    return {**stats(slice(None)), "last_window": stats(slice(-LAST_WINDOW, None))}


class Float32(nn.Module):
    """A float32 copy of ``module`` (the same values: the weights are bf16 values) run on its input upcast; the
    output is rounded back to the input's dtype where ``round_output``."""

    def __init__(self, module: nn.Module, round_output: bool):
        super().__init__()
        self.module, self.round_output = copy.deepcopy(module).float(), round_output

    @property
    def rotary(self) -> nn.Module:
        """A wrapped mixer's rotary module (every mixer has one; the decoder block reads it)."""
        return self.module.rotary

    def forward(self, x: torch.Tensor, *args, **kwargs):
        out = self.module(x.float(), *args, **kwargs)
        return out.to(x.dtype) if self.round_output else out


def replay_increments(model: nn.Module, recorded: list[torch.Tensor] | None) -> list[torch.Tensor]:
    """Record each layer's phase increments (``recorded`` None) or replace them by recorded ones.

    Patches the rotary modules' ``phase_increment`` on the instances, which also sends their calls through the Python
    path (see ``SelectiveRotaryEmbedding._kernel_plan``)."""
    store = [] if recorded is None else list(recorded)
    for block in model.model.layers:
        rotary = block.attn.rotary
        original = rotary.phase_increment

        def phase_increment(*args, _original=original, **kwargs):
            increment, conv_state = _original(*args, **kwargs)
            if recorded is None:
                store.append(increment.clone())
                return increment, conv_state
            return store.pop(0), conv_state

        rotary.phase_increment = phase_increment
    return store


def rounded_phase_input(_module, args, kwargs):
    """Forward pre-hook on a mixer: its phase path reads the bf16 mixer input, as before the bf16 fix."""
    return args, {**kwargs, "phase_input": args[0]}


def ablated(model: nn.Module, name: str, increments: list[torch.Tensor]) -> nn.Module:
    """A bf16 copy of ``model`` with the part ``name`` computed as the float32 model computes it."""
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    for block in bf16.model.layers:
        mixer = block.attn
        if name == "phase_input_rounded":
            mixer.register_forward_pre_hook(rounded_phase_input, with_kwargs=True)
        elif name == "gates_fp32":
            for gate in GATES:
                if getattr(mixer, gate, None) is not None:
                    setattr(mixer, gate, Float32(getattr(mixer, gate), round_output=False))
        elif name == "mixer_fp32":
            block.attn = Float32(mixer, round_output=True)
        elif name == "mlp_fp32":
            block.mlp = Float32(block.mlp, round_output=True)
    if name == "phase_exact":
        replay_increments(bf16, increments)
    elif name == "head_fp32":
        bf16.model.norm, bf16.lm_head = Float32(bf16.model.norm, False), Float32(bf16.lm_head, False)
    return bf16


ABLATIONS = ["baseline", "phase_input_rounded", "phase_exact", "gates_fp32", "mixer_fp32", "mlp_fp32", "head_fp32"]


def run_lengths(family: str, lengths: list[int]) -> dict:
    model = build(family)
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    rows = {}
    for length in lengths:
        ids = tokens(length)
        reference, fp32_s = logits(model, ids)
        other, bf16_s = logits(bf16, ids)
        rows[str(length)] = {**compare(reference, other), "wall_s": {"fp32": round(fp32_s, 2),
                                                                      "bf16": round(bf16_s, 2)}}
        log(f"{family:15s} T={length:6d} {rows[str(length)]}")
    return {"parameters": num_parameters(model), "lengths": rows}


def run_ablations(family: str, length: int) -> dict:
    model = build(family, backend="torch")  # the Python phase path throughout: `phase_exact` patches it
    ids = tokens(length)
    float32 = copy.deepcopy(model)
    increments = replay_increments(float32, None)
    reference, _ = logits(float32, ids)
    rows = {}
    for name in ABLATIONS:
        if name == "phase_input_rounded" and not accepts_phase_input(model):
            continue  # a version before the bf16 fix: its baseline is this
        rows[name] = compare(reference, logits(ablated(model, name, increments), ids)[0])
        log(f"{family:15s} T={length:6d} {name:20s} {rows[name]}")
    return rows


def accepts_phase_input(model: nn.Module) -> bool:
    return "phase_input" in inspect.signature(model.model.layers[0].attn.forward).parameters


def block_before_issue_41(self, hidden_states, state, lengths=None, cu_seqlens=None, backend="torch"):
    """``SelectiveRopeDecoderBlock.forward`` before the bf16 fix: the mixer (phase path included) reads the norm's
    output in the model dtype."""
    hidden_states = hidden_states + self.attn(self.attn_norm(hidden_states), state, lengths=lengths,
                                              cu_seqlens=cu_seqlens, backend=backend)
    return hidden_states + self.mlp(self.mlp_norm(hidden_states))


def speed(rounds: int = 12, steps: int = 10) -> dict:
    """Medians (ms) of the block before the bf16 fix and now, interleaved (the order alternates by round)."""
    forwards = {"before": block_before_issue_41, "now": SelectiveRopeDecoderBlock.forward}
    spec = FAMILIES["gla"]
    torch.manual_seed(0)
    model = spec.lm_class(spec.config_class(vocab_size=1024, hidden_size=256, num_hidden_layers=2, num_heads=4,
                                            use_short_conv=True)).eval()
    ids = torch.randint(3, 1024, (1, 1024))
    results = {}
    try:
        for dtype in (torch.float32, torch.bfloat16):
            m = copy.deepcopy(model).to(dtype)
            times = {name: {"forward_1024": [], "decode_step": [], "train_512": []} for name in forwards}
            with torch.no_grad():
                cache = returned_cache(m(ids[:, :64], use_cache=True))
            for r in range(rounds):
                for name in (list(forwards) if r % 2 else list(forwards)[::-1]):
                    SelectiveRopeDecoderBlock.forward = forwards[name]
                    with torch.no_grad():
                        start = time.perf_counter()
                        m(ids, use_cache=False)
                        times[name]["forward_1024"].append(time.perf_counter() - start)
                        for i in range(steps):
                            start = time.perf_counter()
                            cache = returned_cache(m(ids[:, i:i + 1], past_key_values=cache, use_cache=True))
                            times[name]["decode_step"].append(time.perf_counter() - start)
                    if r < rounds // 2:
                        m.train()
                        start = time.perf_counter()
                        m(ids[:, :512], labels=ids[:, :512]).loss.backward()
                        times[name]["train_512"].append(time.perf_counter() - start)
                        m.eval()
            results[str(dtype).removeprefix("torch.")] = {
                name: {key: round(statistics.median(values) * 1e3, 2) for key, values in record.items()}
                for name, record in times.items()}
            log(f"{dtype}: {results[str(dtype).removeprefix('torch.')]}")
    finally:
        SelectiveRopeDecoderBlock.forward = forwards["now"]
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 32768])
    parser.add_argument("--families", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--ablations", action="store_true", help="also the one-part-at-a-time float32 runs")
    parser.add_argument("--ablation-length", type=int, default=8192)
    parser.add_argument("--speed", action="store_true", help="only the cost of the fix (see the description)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)
    args.quick = False  # start_results' mode field
    threads = torch.get_num_threads()
    try:
        run(args)
    finally:
        torch.set_num_threads(threads)  # the caller's (a test's) again


def run(args: argparse.Namespace) -> None:
    if args.speed:
        torch.set_num_threads(1)
        results = start_results("bf16_precision --speed", args, 1, ROOT, SOURCES, {"rounds": 12, "steps": 10})
        results["speed_ms"] = speed()
        write_results(args.output or DEFAULT_OUTPUT.with_name("bf16_precision_speed.json"), results)
        return
    torch.set_num_threads(args.threads)
    plan = {"lengths": args.lengths, "families": args.families, "last_window": LAST_WINDOW,
            "ablation_length": args.ablation_length if args.ablations else None}
    results = start_results("bf16_precision", args, args.threads, ROOT, SOURCES, plan)
    results["model_configs"] = CONFIGS
    results["families"] = {family: run_lengths(family, args.lengths) for family in args.families}
    if args.ablations:
        results["ablations"] = {family: run_ablations(family, args.ablation_length) for family in args.families}
    write_results(args.output or DEFAULT_OUTPUT, results)


if __name__ == "__main__":
    main()
