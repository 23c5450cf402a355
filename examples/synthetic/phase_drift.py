"""Diagnose a trained parity model: the rotation angle each bit adds (per head and frequency) and where along a long
sequence the running-parity answers start to fail.

    python examples/synthetic/train.py --task parity --variant selective --seed 2 --save-model /tmp/parity_s2 \
        --output /tmp/parity_s2.json
    python examples/synthetic/phase_drift.py /tmp/parity_s2

Selective RoPE solves parity when one frequency turns by π on a 1 and by 0 (mod 2π) on a 0 (or by π/2 and 0: a
counter mod 4, which the block after the rotation can also read). A model trained on 40 bits only needs the 0-angle to
be small enough over 40 tokens; whatever is left (the *drift*, the angle both bits add in common) accumulates with
length and flips the answers once it reaches half the gap between the two angles, if nothing else cancels it.

That estimate reads one frequency against the BOS token. A model can also cancel a drift with a second head that
turns by the opposite angle on every token (a clock), and then extrapolates despite it. ``--zero-phase HEAD[:FREQ]``
tests which rotations a model relies on: it zeroes that key head's phase increments (one frequency, or all) in every
layer and measures the accuracy by position again.

    python examples/synthetic/phase_drift.py /tmp/parity_s2 --zero-phase 1 --zero-phase 0:0
"""

from __future__ import annotations

import argparse
import math
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tasks import Parity  # noqa: E402


def wrap(angle: torch.Tensor) -> torch.Tensor:
    """Into (-π, π]."""
    return torch.remainder(angle + math.pi, 2 * math.pi) - math.pi


@torch.no_grad()
def angles_per_bit(model) -> list[dict]:
    """For each layer and key head, at the frequency where a 1 and a 0 turn the most differently: the angle (τ_i · c)
    each adds, and after how many tokens the angle both add in common (the drift) has used up half the gap between
    the two (when answers start to flip). Computed with the library's rotary module on each block's normalised input.
    """
    ids = torch.tensor([[Parity.BOS, 0, 1, 0, 1]])
    hidden_states = model(ids, output_hidden_states=True).hidden_states  # the input of each block, then the output
    rows = []
    for index, layer in enumerate(model.model.layers):
        rotary = layer.attn.rotary
        if rotary.position_embedding != "selective_rope":
            continue
        x = layer.attn_norm(hidden_states[index])
        increment, _ = rotary.phase_increment(x, None, None, None)  # (1, T, Hk, R)
        angle = increment[0] * rotary.temperature.float()           # (T, Hk, R)
        zero, one = angle[3], angle[4]  # a 0 and a 1 after the same history (matters only with a phase convolution)
        for head in range(angle.shape[1]):
            gap = wrap(one[head] - zero[head]).abs()
            best = int(gap.argmax())
            drift = float(wrap(zero[head, best]))
            rows.append({"layer": index, "head": head, "frequency": best, "gap_over_pi": float(gap[best]) / math.pi,
                         "angle_0_over_pi": drift / math.pi, "angle_1_over_pi": float(wrap(one[head, best])) / math.pi,
                         "flip_after_tokens": float(gap[best]) / 2 / abs(drift) if drift else math.inf})
    return rows


@torch.no_grad()
def accuracy_by_position(model, length: int = 160, block: int = 10, seed: int = 5) -> list[float]:
    data = Parity.sample(256, length, torch.Generator().manual_seed(seed))
    predicted = model(data.input_ids).logits.argmax(-1)
    correct = (predicted == data.targets)[:, 1:length + 1].float().mean(0)
    return [round(correct[i:i + block].mean().item(), 3) for i in range(0, length, block)]


@torch.no_grad()
def errors_on_patterns(model, length: int = 160) -> dict[str, list[int]]:
    """Positions (1-based bit index) answered wrongly on all-0, all-1 and alternating strings: a drift of the 0-angle
    shows on the first, of the 1-angle on the second, of both on the third."""
    patterns = {"zeros": [0] * length, "ones": [1] * length, "alternating": [0, 1] * (length // 2) + [0] * (length % 2)}
    errors = {}
    for name, bits in patterns.items():
        batch = Parity.from_bits(torch.tensor([bits]))
        predicted = model(batch.input_ids).logits.argmax(-1)[0, 1:length + 1]  # the answers after b_1 ... b_n
        errors[name] = [int(i) + 1 for i in (predicted != batch.targets[0, 1:length + 1]).nonzero().flatten()]
    return errors


@contextmanager
def phase_zeroed(model, head: int, frequency: int | None = None):
    """Within the block, key head ``head`` of every Selective RoPE layer adds no phase at ``frequency`` (or at any
    frequency when None), so a fresh forward leaves that head's q and k unrotated there. Patches
    ``phase_increment``, which full-sequence forwards on the torch backend call, and runs the model on that backend
    (not the compiled CPU kernel, nor the fused Triton decode step, which compute the increment themselves)."""
    rotaries = [layer.attn.rotary for layer in model.model.layers
                if layer.attn.rotary.position_embedding == "selective_rope"]
    for rotary in rotaries:
        if not 0 <= head < rotary.num_key_heads or not (frequency is None or 0 <= frequency < rotary.rotary_pairs):
            raise ValueError(f"no key head {head} / frequency {frequency} (the model has {rotary.num_key_heads} "
                             f"key heads of {rotary.rotary_pairs} frequencies)")

    def without(original):
        def phase_increment(*args, **kwargs):
            increment, conv_state = original(*args, **kwargs)  # (B, T, Hk, R)
            increment = increment.clone()
            increment[:, :, head, slice(None) if frequency is None else frequency] = 0.0
            return increment, conv_state
        return phase_increment

    # A diagnostic patch on the instances (not the class), undone on exit.
    # The torch backend is the path that calls phase_increment: the model's (resolved per forward from its config)
    # and the modules' own (a direct call).
    backends = [model.config, *rotaries], [model.config.backend] + [rotary.backend for rotary in rotaries]
    for owner in backends[0]:
        owner.backend = "torch"
    for rotary in rotaries:
        rotary.phase_increment = without(rotary.phase_increment)
    try:
        yield
    finally:
        for owner, backend in zip(*backends):
            owner.backend = backend
        for rotary in rotaries:
            del rotary.phase_increment


def parse_head(text: str) -> tuple[int, int | None]:
    head, _, frequency = text.partition(":")
    try:
        return int(head), int(frequency) if frequency else None
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected HEAD or HEAD:FREQUENCY, got {text!r}") from None


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoModelForCausalLM

    import selective_rope  # noqa: F401

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", type=Path, help="a directory written by train.py --save-model")
    parser.add_argument("--length", type=int, default=160)
    parser.add_argument("--zero-phase", type=parse_head, action="append", default=[], metavar="HEAD[:FREQ]",
                        help="also measure with this key head's phase (at one frequency) zeroed; repeatable")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(args.model).eval()
    for row in angles_per_bit(model):
        print(f"layer {row['layer']} head {row['head']} frequency {row['frequency']}: a 0 turns by "
              f"{row['angle_0_over_pi']:+.4f}π, a 1 by {row['angle_1_over_pi']:+.4f}π (gap {row['gap_over_pi']:.3f}π)"
              f" -> the common drift uses up half the gap after ~{row['flip_after_tokens']:.0f} tokens")
    print(f"running-parity accuracy by blocks of 10 positions (length {args.length}):",
          accuracy_by_position(model, args.length))
    for name, wrong in errors_on_patterns(model, args.length).items():
        first = f", first at bit {wrong[0]}" if wrong else ""
        print(f"{name} ({args.length} bits): {len(wrong)} wrong answers{first}")
    for head, frequency in args.zero_phase:
        with phase_zeroed(model, head, frequency):
            where = f"head {head}" + ("" if frequency is None else f" frequency {frequency}")
            print(f"  with the phase of {where} zeroed:", accuracy_by_position(model, args.length))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
