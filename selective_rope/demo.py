"""The main job: train a tiny selective-rope model on CPU (SelectiveRopeGLA unless another family is asked for),
save it, reload it through AutoModelForCausalLM, generate, and say whether it learned.

Task (synthetic, built here): arithmetic progressions modulo ``MODULUS``. Each sequence starts at a random value
with a random step, ``a, a+d, a+2d, ...``; the model must infer ``d`` from the prompt and continue the sequence.

Training runs a number of steps, with a time cap; the run ends with a verdict line (``learned: ...`` or
``did NOT learn: ...``) and the command's exit status is 1 when the model did not learn.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

MODULUS = 32
BOS, PAD = MODULUS, MODULUS + 1  # token ids after the numbers
LEARNED_ACCURACY = 0.9  # continuation accuracy at which the demo says it learned (chance: 1 / MODULUS)
# One thread: the demo's ops (32 x 25 tokens, width 64) are too small to gain from more, and on a machine whose
# cores other processes keep busy every multi-threaded op waits for a descheduled OpenMP thread (libgomp spins,
# then sleeps): a step took 24 s with 2 threads next to 4 busy processes on 2 cores, 0.57 s with one (docs/demo.md).
DEMO_THREADS = 1


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


def train(model, seconds: float, max_steps: int, generator: torch.Generator, batch: int = 32,
          length: int = 24) -> tuple[float, int]:
    """Train ``max_steps`` steps, or for ``seconds`` if that ends first; returns the last loss and the steps taken.

    The progress bar counts steps, so its remaining time is the ETA of the whole run."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    # Cosine decay over the planned steps: the last steps settle instead of hopping around the minimum.
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max_steps, eta_min=3e-4)
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
        schedule.step()
        progress.set_postfix(loss=f"{loss.item():.3f}")
        progress.update()
        if time.monotonic() > deadline and progress.n < max_steps:
            # The time budget ended the run: close the bar at 100 % of the steps taken (a bar stopped part-way
            # looks like a crash) and say why it stopped.
            progress.total = progress.n
            progress.set_description(f"training ({seconds:g} s cap reached)")
            break
    steps = progress.n
    progress.close()
    model.eval()
    return (loss.item() if loss is not None else float("nan")), steps


def verdict(accuracy: float, before: float, steps: int, max_steps: int, seconds: float) -> tuple[bool, str]:
    """Whether the demo model learned the task, and the line that says so."""
    learned = accuracy >= LEARNED_ACCURACY
    scores = (f"{accuracy:.1%} of greedy continuations correct after {steps} training steps ({before:.1%} before "
              f"training; {LEARNED_ACCURACY:.0%} needed)")
    if learned:
        return True, f"learned: {scores}"
    if steps < max_steps:
        return False, (f"did NOT learn: {scores}; the {seconds:g} s time cap stopped training at step {steps} of "
                       f"{max_steps}: give it more time (--seconds)")
    return False, f"did NOT learn: {scores}; train longer (--max-steps) or try another --seed"


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


def run_demo(output_dir: str = "demo_output", seconds: float = 600.0, max_steps: int = 600, seed: int = 0,
             family: str = "gla") -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(DEMO_THREADS)
    try:
        return _run_demo(output_dir, seconds, max_steps, seed, family)
    finally:
        torch.set_num_threads(threads)  # a caller's own setting comes back


def _run_demo(output_dir: str, seconds: float, max_steps: int, seed: int, family: str) -> dict:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    model = AutoModelForCausalLM.from_config(demo_config(family))
    print(f"{type(model).__name__}: {sum(p.numel() for p in model.parameters()):,} parameters; "
          f"task: continue arithmetic progressions mod {MODULUS}")
    before = continuation_accuracy(model.eval(), generator)
    print(f"accuracy before training: {before:.1%}")
    final_loss, steps = train(model, seconds, max_steps, generator)

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
    learned, line = verdict(accuracy, before, steps, max_steps, seconds)
    print(line)
    return {"final_loss": final_loss, "accuracy": accuracy, "generated": generated.tolist(), "output_dir": str(output),
            "steps": steps, "learned": learned}


# -- selective-rope demo --------------------------------------------------------------------------------------------

def add_parser(commands) -> argparse.ArgumentParser:
    from .families import FAMILY_NAMES

    parser = commands.add_parser("demo", help="train a tiny model on CPU, save, reload and generate",
                                 description="Train a tiny selective-rope model (SelectiveRopeGLA by default) on a "
                                 "synthetic task (continuing arithmetic progressions), save it, reload it with "
                                 "AutoModelForCausalLM and generate. The last line says whether it learned "
                                 f"(continuation accuracy >= {LEARNED_ACCURACY:.0%}); the exit status is 1 when not.")
    parser.add_argument("--family", choices=FAMILY_NAMES, default="gla", help="model family (default gla)")
    parser.add_argument("--output-dir", default="demo_output", help="where the trained model is saved")
    parser.add_argument("--max-steps", type=int, default=600, help="training steps (default 600)")
    parser.add_argument("--seconds", type=float, default=600.0,
                        help="time cap on training: it stops there even if steps remain (default 600)")
    parser.add_argument("--seed", type=int, default=0)
    return parser


def run(args: argparse.Namespace) -> int:
    if args.seconds <= 0 or args.max_steps <= 0:
        raise SystemExit("selective-rope demo: --seconds and --max-steps must be positive")
    result = run_demo(args.output_dir, args.seconds, args.max_steps, args.seed, args.family)
    return 0 if result["learned"] else 1
