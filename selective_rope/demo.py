"""The main job: train a tiny selective-rope model on CPU (SelectiveRopeGLA unless another family is asked for),
save it, reload it through AutoModelForCausalLM, generate.

Task (synthetic, built here): arithmetic progressions modulo ``MODULUS``. Each sequence starts at a random value
with a random step, ``a, a+d, a+2d, ...``; the model must infer ``d`` from the prompt and continue the sequence.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

MODULUS = 32
BOS, PAD = MODULUS, MODULUS + 1  # token ids after the numbers


def progressions(batch: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """``(batch, 1 + length)``: BOS then ``length`` terms of random progressions mod MODULUS."""
    start = torch.randint(0, MODULUS, (batch, 1), generator=generator)
    step = torch.randint(1, MODULUS, (batch, 1), generator=generator)
    terms = (start + step * torch.arange(length)) % MODULUS
    return torch.cat([torch.full((batch, 1), BOS), terms], dim=1)


def demo_config(family: str = "gla"):
    """A 2-layer, ~0.1 M-parameter model of ``family`` (a name in :data:`selective_rope.families.FAMILIES`)."""
    from .families import get_family

    spec = get_family(family)
    # The hybrid's default layer_types put attention on every fourth layer (Qwen3-Next's rule): none in two layers.
    layers = {"layer_types": ["linear_attention", "full_attention"]} if family == "hybrid" else {}
    return spec.config_class(vocab_size=MODULUS + 2, hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                             bos_token_id=BOS, eos_token_id=None, pad_token_id=PAD, phase_bias=True,
                             initializer_range=0.05, **layers, **spec.head_layout(64, 2, square=True))


def train(model, seconds: float, max_steps: int, generator: torch.Generator, batch: int = 32, length: int = 24):
    """Train for ``seconds`` or ``max_steps`` steps, whichever ends first; returns the last loss."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    model.train()
    deadline = time.monotonic() + seconds
    progress = tqdm(total=max_steps, desc="training", unit="step")
    loss = None
    for _ in range(max_steps):
        ids = progressions(batch, length, generator)
        labels = ids.clone()
        labels[:, :3] = -100  # the step is unknown until two terms are seen
        loss = model(ids, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        progress.set_postfix(loss=f"{loss.item():.3f}")
        progress.update()
        if time.monotonic() > deadline and progress.n < max_steps:
            # The time budget ended the run: close the bar at 100 % of the steps taken (a bar stopped part-way
            # looks like a crash) and say why it stopped.
            progress.total = progress.n
            progress.set_description(f"training ({seconds:g} s budget reached)")
            break
    progress.close()
    model.eval()
    return loss.item() if loss is not None else float("nan")


@torch.no_grad()
def continuation_accuracy(model, generator: torch.Generator, prompts: int = 64, new_tokens: int = 8) -> float:
    """Greedy continuations of left-padded prompts of mixed lengths, scored against the true progression."""
    total = progressions(prompts, 16 + new_tokens, generator)
    lengths = torch.randint(4, 17, (prompts,), generator=generator)
    width = int(lengths.max()) + 1
    ids = torch.full((prompts, width), PAD)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths.tolist()):
        ids[i, width - n - 1:], mask[i, width - n - 1:] = total[i, : n + 1], 1
    out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, pad_token_id=PAD)
    expected = torch.stack([total[i, n + 1 : n + 1 + new_tokens] for i, n in enumerate(lengths.tolist())])
    return (out[:, width:] == expected).float().mean().item()


def run_demo(output_dir: str = "demo_output", seconds: float = 60.0, max_steps: int = 2000, seed: int = 0,
             family: str = "gla") -> dict:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    model = AutoModelForCausalLM.from_config(demo_config(family))
    print(f"{type(model).__name__}: {sum(p.numel() for p in model.parameters()):,} parameters; "
          f"task: continue arithmetic progressions mod {MODULUS}")
    print(f"accuracy before training: {continuation_accuracy(model.eval(), generator):.1%}")
    final_loss = train(model, seconds, max_steps, generator)

    output = Path(output_dir)
    model.save_pretrained(output)
    reloaded = AutoModelForCausalLM.from_pretrained(output)
    print(f"saved to {output}/ and reloaded as {type(reloaded).__name__}")
    accuracy = continuation_accuracy(reloaded, torch.Generator().manual_seed(seed + 1))
    print(f"final training loss {final_loss:.3f}; greedy continuation accuracy (left-padded batch): {accuracy:.1%}")

    prompt = [5, 12, 19, 26]
    expected = [(26 + 7 * i) % MODULUS for i in range(1, 7)]
    ids = torch.tensor([[BOS, *prompt]])
    generated = reloaded.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=PAD)[0, 1 + len(prompt):]
    print(f"prompt {' '.join(map(str, prompt))} -> generated {' '.join(map(str, generated.tolist()))} "
          f"(expected {' '.join(map(str, expected))})")
    return {"final_loss": final_loss, "accuracy": accuracy, "generated": generated.tolist(), "output_dir": str(output)}


# -- selective-rope demo --------------------------------------------------------------------------------------------

def add_parser(commands) -> argparse.ArgumentParser:
    from .families import FAMILY_NAMES

    parser = commands.add_parser("demo", help="train a tiny model on CPU, save, reload and generate",
                                 description="Train a tiny selective-rope model (SelectiveRopeGLA by default) on a "
                                 "synthetic task (continuing arithmetic progressions), save it, reload it with "
                                 "AutoModelForCausalLM and generate.")
    parser.add_argument("--family", choices=FAMILY_NAMES, default="gla", help="model family (default gla)")
    parser.add_argument("--output-dir", default="demo_output", help="where the trained model is saved")
    parser.add_argument("--seconds", type=float, default=60.0, help="training time budget (default 60)")
    parser.add_argument("--max-steps", type=int, default=2000, help="upper bound on training steps")
    parser.add_argument("--seed", type=int, default=0)
    return parser


def run(args: argparse.Namespace) -> int:
    if args.seconds <= 0 or args.max_steps <= 0:
        raise SystemExit("selective-rope demo: --seconds and --max-steps must be positive")
    run_demo(args.output_dir, args.seconds, args.max_steps, args.seed, args.family)
    return 0
