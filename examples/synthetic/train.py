"""Train one tiny model on one synthetic task (parity / A3 / MQAR / copy / the MAD recall tasks) on CPU and write a
results JSON.

    python examples/synthetic/train.py --task parity --variant selective --seed 0

Variants (the position embedding of every mixer; everything else is identical):

    nope                 position_embedding="nope"
    rope                 position_embedding="rope"
    selective            Selective RoPE as the library's default: phase gate on, no bias
    selective_plain      Selective RoPE without phase gate and without bias  (the paper's Table 2 rows)
    selective_bias       bias, no gate
    selective_gate_bias  gate and bias
    paper                the paper's state-tracking Selective RoPE (official ``configs/state_tracking``): every
                         temperature 1 (``temperature_type="rope"``, ``temperature_theta=1``), no phase gate, phase
                         bias, phase convolution of size 4; the task's ``phase_conv_size=0`` default does not apply
    paper_theta500k      ``paper`` with the library's default temperature (RoPE schedule, base 500000)
    paper_gate           ``paper`` with the phase gate on
    paper_nobias         ``paper`` without the phase bias
    paper_noconv         ``paper`` without the phase convolution

The model is built through the library's public API (``AutoModelForCausalLM.from_config`` on a family config) and
trained with its own loss (``model(input_ids, attention_mask=..., labels=...).loss``). The budget is a fixed number
of optimizer steps (``--steps``); ``--max-seconds`` is only a safety cap, and the JSON says whether it was hit.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
for folder in (HERE, HERE.parent):  # tasks.py here; examples/example_utils.py, the helpers the example scripts share
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

from example_utils import lr_at, read_runs, store_run  # noqa: E402
from mad import MAD_TASKS  # noqa: E402
from tasks import A3, IGNORE, MQAR, Copy, Parity  # noqa: E402
from tasks import TASKS as BASIC_TASKS  # noqa: E402

from selective_rope.configuration import PRESETS  # noqa: E402

TASKS = BASIC_TASKS + tuple(MAD_TASKS)
REPO = HERE.parent.parent
RESULTS = REPO / "benchmarks" / "results" / "synthetic.jsonl"  # every run, one line each, keyed by --run

VARIANTS = {
    "nope": dict(position_embedding="nope"),
    "rope": dict(position_embedding="rope"),
    "selective": dict(position_embedding="selective_rope", phase_gate=True, phase_bias=False),
    "selective_plain": dict(position_embedding="selective_rope", phase_gate=False, phase_bias=False),
    "selective_bias": dict(position_embedding="selective_rope", phase_gate=False, phase_bias=True),
    "selective_gate_bias": dict(position_embedding="selective_rope", phase_gate=True, phase_bias=True),
}
# The paper's state-tracking Selective RoPE, and its one-change ablations (docs/synthetic.md, "The paper's setup").
PAPER_STATE_TRACKING = dict(PRESETS["state_tracking"])
VARIANTS.update({
    "paper": PAPER_STATE_TRACKING,
    "paper_theta500k": dict(PAPER_STATE_TRACKING, temperature_theta=500000.0),
    "paper_gate": dict(PAPER_STATE_TRACKING, phase_gate=True),
    "paper_nobias": dict(PAPER_STATE_TRACKING, phase_bias=False),
    "paper_noconv": dict(PAPER_STATE_TRACKING, phase_conv_size=0),
})

# Optimizer defaults shared by every task (AdamW; cosine decay from lr to lr_floor * lr).
OPTIMIZER_DEFAULTS = dict(weight_decay=0.01, lr_floor=0.1, label_smoothing=0.0, curriculum_steps=0,
                          schedule="cosine", min_train_length=None)

# Per-task defaults: model size, data, budget and evaluation lengths. Every entry can be overridden on the command line.
TASK_DEFAULTS = {
    # phase_conv_size=0 for parity: see docs/synthetic.md (with the default convolution of 4 the same budget fails)
    "parity": dict(family="gla", layers=1, hidden=64, heads=2, steps=600, batch=64, lr=3e-3,
                   train_length=40, eval_lengths=[20, 40, 80, 160, 320], eval_batch=256, bit_density="half",
                   config=dict(phase_conv_size=0)),
    # A3 (docs/evidence.md): 2-layer Gated DeltaNet; the paper trains at 128 and tests to 512 elements
    "a3": dict(family="gated_deltanet", layers=2, hidden=64, heads=2, steps=600, batch=64, lr=3e-3,
               train_length=32, eval_lengths=[32, 64, 128], eval_batch=256),
    "mqar": dict(family="gla", layers=2, hidden=64, heads=2, steps=400, batch=64, lr=3e-3,
                 train_length=8, eval_lengths=[4, 8, 16, 24], eval_batch=256, num_keys=32),
    "copy": dict(family="gla", layers=2, hidden=64, heads=2, steps=1000, batch=32, lr=3e-3,
                 train_length=16, min_length=2, eval_lengths=[8, 16, 32, 64], eval_batch=128, alphabet=26),
}
# The MAD recall tasks (docs/evidence.md) at MAD's baseline vocabularies, sequences scaled down for the CPU: 2-layer
# GLA, hidden 64; `mad` holds the generator's own arguments (examples/synthetic/mad.py).
MAD_MODEL = dict(family="gla", layers=2, hidden=64, heads=2, steps=400, batch=32, lr=3e-3, eval_batch=256)
TASK_DEFAULTS.update({
    "compress": dict(MAD_MODEL, train_length=32, eval_lengths=[32], mad=dict(vocab_size=16)),
    "fuzzy_recall": dict(MAD_MODEL, train_length=64, eval_lengths=[64], mad=dict(vocab_size=16)),
    "in_context_recall": dict(MAD_MODEL, train_length=64, eval_lengths=[64], mad=dict(vocab_size=16)),
    "memorize": dict(MAD_MODEL, train_length=32, eval_lengths=[32], mad=dict(vocab_size=256)),
    "noisy_recall": dict(MAD_MODEL, train_length=64, eval_lengths=[64],
                         mad=dict(vocab_size=32, noise_vocab_size=16, frac_noise=0.2)),
    "selective_copy": dict(MAD_MODEL, train_length=64, eval_lengths=[64], mad=dict(vocab_size=16, tokens_to_copy=8)),
})
LENGTH_UNIT = {"parity": "bits", "a3": "group elements", "mqar": "key-value pairs", "copy": "string length",
               **{name: "tokens" for name in MAD_TASKS}}


# ----------------------------------------------------------------------------------------------------------- model

def build_config(task, family: str, variant: str, layers: int, hidden: int, heads: int, overrides: dict):
    from selective_rope.families import get_family

    spec = get_family(family)
    common = dict(vocab_size=task.vocab_size, hidden_size=hidden, num_hidden_layers=layers,
                  intermediate_size=2 * hidden, bos_token_id=None, eos_token_id=None, pad_token_id=None,
                  tie_word_embeddings=False, initializer_range=0.05, **VARIANTS[variant])
    kwargs = dict(common, **spec.head_layout(hidden, heads, square=True))
    kwargs.update(overrides)
    return spec.config_class(**kwargs)


def task_settings(task_name: str, **overrides) -> dict:
    """The optimizer and task defaults for ``task_name`` with ``overrides`` applied (``None`` keeps the default)."""
    if task_name not in TASK_DEFAULTS:
        raise ValueError(f"unknown task {task_name!r}; expected one of {list(TASKS)}")
    settings = dict(OPTIMIZER_DEFAULTS, **TASK_DEFAULTS[task_name])
    settings.update({key: value for key, value in overrides.items() if value is not None})
    return settings


def make_task(name: str, settings: dict):
    if name == "parity":
        return Parity()
    if name == "a3":
        return A3()
    if name in MAD_TASKS:
        return MAD_TASKS[name](**settings["mad"])
    if name == "mqar":
        return MQAR(settings["num_keys"])
    if name == "copy":
        return Copy(settings["alphabet"])
    raise ValueError(f"unknown task {name!r}; expected one of {list(TASKS)}")


def sample(task, settings: dict, batch: int, length: int, generator: torch.Generator, train: bool):
    if task.name == "parity":  # evaluation always reads fair bits; training may vary the density of 1s
        return task.sample(batch, length, generator, settings["bit_density"] if train else "half")
    if task.name in ("a3", "mqar"):
        return task.sample(batch, length, generator)
    if task.name in MAD_TASKS:  # recall tasks: next-token training, scored only where a value can be recalled
        return task.sample(batch, length, generator, train)
    if task.name == "copy":  # training draws lengths in [min, train]; evaluation uses exactly `length`
        return task.sample(batch, settings["min_length"] if train else length, length, generator)
    raise ValueError(task.name)


# ------------------------------------------------------------------------------------------------------ evaluation

@torch.no_grad()
def evaluate(model, task, settings: dict, length: int, seed: int) -> dict:
    """Accuracy at one test length (fresh held-out data from its own generator)."""
    generator = torch.Generator().manual_seed(10_000 + 7919 * seed + length)
    data = sample(task, settings, settings["eval_batch"], length, generator, train=False)
    logits = model(data.input_ids, attention_mask=data.attention_mask).logits
    predicted = logits.argmax(-1)
    scored = data.targets != IGNORE
    correct = (predicted == data.targets) & scored
    result = {
        "length": length,
        "sequence_length": int(data.input_ids.shape[1]),
        "examples": int(data.input_ids.shape[0]),
        "token_accuracy": correct.sum().item() / scored.sum().item(),
        # every scored answer of a sequence right (parity: every prefix; copy: the whole string, = greedy exact match)
        "sequence_accuracy": (correct.sum(1) == scored.sum(1)).float().mean().item(),
    }
    if task.name in ("parity", "a3"):
        final = task.final_position(length)
        result["final_token_accuracy"] = correct[:, final].float().mean().item()
    return result


# -------------------------------------------------------------------------------------------------------- training

def onecycle_lr_at(step: int, steps: int, lr: float) -> float:
    """``torch.optim.lr_scheduler.OneCycleLR`` with its defaults (30 % cosine warm-up from lr / 25, then cosine
    annealing to lr / 25 / 1e4), as the paper's state-tracking runs use; computed in closed form."""
    warm = 0.3 * steps - 1
    start, end = lr / 25, lr / 25 / 1e4

    def cos_anneal(a: float, b: float, fraction: float) -> float:
        return b + (a - b) / 2 * (1 + math.cos(math.pi * fraction))

    if step <= warm:
        return cos_anneal(start, lr, step / warm)
    return cos_anneal(lr, end, (step - warm) / (steps - 1 - warm))


def length_at(step: int, train_length: int, curriculum_steps: int, start: int = 8) -> int:
    """Training length at ``step``: ramps linearly from ``start`` to ``train_length`` over ``curriculum_steps``
    (0: always ``train_length``). Short sequences first give parity a cleaner signal before the long ones."""
    if curriculum_steps <= 0 or step >= curriculum_steps:
        return train_length
    first = min(start, train_length)
    return first + (train_length - first) * step // curriculum_steps


def training_loss(model, data, label_smoothing: float = 0.0) -> torch.Tensor:
    """The model's own causal-LM loss; with ``label_smoothing > 0`` the same shifted cross-entropy, smoothed.

    Smoothing keeps the loss from saturating once every answer is right: the best logit margin becomes finite, so an
    answer whose margin shrinks with position (a drifting phase in parity) keeps a gradient until the drift is gone.
    """
    if not label_smoothing:
        return model(data.input_ids, attention_mask=data.attention_mask, labels=data.labels).loss
    logits = model(data.input_ids, attention_mask=data.attention_mask).logits.float()  # (B, T, V)
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), data.labels[:, 1:].flatten(),
                                             ignore_index=IGNORE, label_smoothing=label_smoothing)


def train(model, task, settings: dict, seed: int, log_every: int = 25, max_seconds: float | None = None,
          fixed_batch=None, quiet: bool = False) -> dict:
    """AdamW on fresh batches (or on ``fixed_batch`` every step); returns the loss curve and timing."""
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings["lr"], weight_decay=settings["weight_decay"])
    steps = settings["steps"]
    curve, losses = [], []
    start = time.perf_counter()
    stopped_by_time = False
    model.train()
    step = 0
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = (onecycle_lr_at(step, steps, settings["lr"]) if settings["schedule"] == "onecycle"
                           else lr_at(step, steps, settings["lr"], floor=settings["lr_floor"]))
        length = length_at(step, settings["train_length"], settings["curriculum_steps"])
        if settings["min_train_length"] is not None:  # every batch its own length in [min, train_length]
            length = int(torch.randint(settings["min_train_length"], settings["train_length"] + 1, (1,),
                                       generator=generator))
        data = fixed_batch or sample(task, settings, settings["batch"], length, generator, True)
        loss = training_loss(model, data, settings["label_smoothing"])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        if (step + 1) % log_every == 0 or step == steps - 1:
            mean = sum(losses) / len(losses)
            curve.append({"step": step + 1, "loss": mean, "seconds": time.perf_counter() - start})
            losses = []
            if not quiet:
                print(f"  step {step + 1:5d}  loss {mean:.4f}  {time.perf_counter() - start:6.1f}s", flush=True)
        if max_seconds is not None and time.perf_counter() - start > max_seconds:
            stopped_by_time = True
            break
    model.eval()
    return {"loss_curve": curve, "steps_done": step + 1, "stopped_by_time_cap": stopped_by_time,
            "train_seconds": time.perf_counter() - start}


# ------------------------------------------------------------------------------------------------------- metadata

def machine() -> dict:
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {"platform": platform.platform(), "python": platform.python_version(), "cpu": cpu,
            "logical_cpus": os.cpu_count(), "torch_threads": torch.get_num_threads()}
    try:
        info["loadavg_at_end"] = list(os.getloadavg())
    except OSError:
        pass
    return info


def git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


# ------------------------------------------------------------------------------------------------------------- run

def run(task_name: str, variant: str, seed: int, output: Path | None = None, overrides: dict | None = None,
        quiet: bool = False, max_seconds: float | None = 900.0, save_model: Path | None = None,
        **settings_overrides) -> dict:
    import transformers
    from transformers import AutoModelForCausalLM

    import selective_rope  # noqa: F401  (registers the Auto classes)

    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; expected one of {list(VARIANTS)}")
    settings = task_settings(task_name, **settings_overrides)
    task_config = {k: v for k, v in settings.pop("config", {}).items() if k not in VARIANTS[variant]}
    overrides = {**task_config, **(overrides or {})}
    task = make_task(task_name, settings)

    torch.manual_seed(seed)
    config = build_config(task, settings["family"], variant, settings["layers"], settings["hidden"],
                          settings["heads"], overrides)
    model = AutoModelForCausalLM.from_config(config)
    if hasattr(task, "wrap_model"):  # compress: MAD's auto-encoder around the backbone
        model = task.wrap_model(model)
    parameters = sum(p.numel() for p in model.parameters())
    if not quiet:
        print(f"{task_name} / {variant} / seed {seed}: {type(model).__name__}, {parameters:,} parameters", flush=True)

    wall = time.perf_counter()
    training = train(model, task, settings, seed, max_seconds=max_seconds, quiet=quiet)
    eval_start = time.perf_counter()
    evaluation = [evaluate(model, task, settings, length, seed) for length in settings["eval_lengths"]]
    eval_seconds = time.perf_counter() - eval_start
    if not quiet:
        for row in evaluation:
            extra = f"  final {row['final_token_accuracy']:.3f}" if "final_token_accuracy" in row else ""
            print(f"  eval {LENGTH_UNIT[task_name]}={row['length']:4d}: token {row['token_accuracy']:.3f}  "
                  f"sequence {row['sequence_accuracy']:.3f}{extra}", flush=True)

    result = {
        "task": task_name,
        "variant": variant,
        "variant_fields": VARIANTS[variant],
        "seed": seed,
        "family": settings["family"],
        "config_overrides": overrides,
        "model_config": config.to_diff_dict(),
        "parameters": parameters,
        "budget": {
            "steps": settings["steps"], "steps_done": training["steps_done"], "batch": settings["batch"],
            "lr": settings["lr"],
            "schedule": (f"AdamW, OneCycle (30% warm-up from lr/25, cosine to lr/25e4), weight decay "
                         f"{settings['weight_decay']:g}, clip 1.0" if settings["schedule"] == "onecycle" else
                         f"AdamW, 5% linear warm-up, cosine to {settings['lr_floor']:g} x lr, "
                         f"weight decay {settings['weight_decay']:g}, clip 1.0"),
            "loss": (f"shifted cross-entropy, label smoothing {settings['label_smoothing']:g}"
                     if settings["label_smoothing"] else "the model's own loss (labels=...)"),
            "train_length": settings["train_length"], "min_train_length": settings["min_train_length"],
            "stopped_by_time_cap": training["stopped_by_time_cap"],
        },
        "task_settings": settings,
        "length_unit": LENGTH_UNIT[task_name],
        "eval": evaluation,
        "final_loss": training["loss_curve"][-1]["loss"] if training["loss_curve"] else None,
        "loss_curve": training["loss_curve"],
        "train_seconds": training["train_seconds"],
        "eval_seconds": eval_seconds,
        "wall_seconds": time.perf_counter() - wall,
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "machine": machine(),
        "git_commit": git_commit(),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]) if sys.argv else None,
    }
    if save_model is not None:  # e.g. for phase_drift.py; loads back with AutoModelForCausalLM.from_pretrained
        model.save_pretrained(save_model)
        result["saved_model"] = str(save_model)
    if output is not None:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(json.dumps(result, indent=1) + "\n")
        if not quiet:
            print(f"  wrote {output}", flush=True)
    return result


def parse_overrides(pairs: list[str]) -> dict:
    """``key=value`` pairs, values parsed as JSON when possible (``temperature_max=3.14``, ``phase_gate=false``)."""
    overrides = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"--set expects key=value, got {pair!r}")
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key] = value
    return overrides


def main(argv: list[str] | None = None) -> int:
    from selective_rope.families import FAMILY_NAMES

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", choices=TASKS, required=True)
    parser.add_argument("--variant", choices=list(VARIANTS), required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--family", choices=FAMILY_NAMES)
    parser.add_argument("--layers", type=int)
    parser.add_argument("--hidden", type=int)
    parser.add_argument("--heads", type=int)
    parser.add_argument("--steps", type=int)
    parser.add_argument("--batch", type=int)
    parser.add_argument("--lr", type=float)
    parser.add_argument("--weight-decay", type=float, help="AdamW weight decay (default 0.01)")
    parser.add_argument("--lr-floor", type=float, help="final learning rate as a fraction of --lr (default 0.1)")
    parser.add_argument("--label-smoothing", type=float, help="smoothed cross-entropy (default 0: the model's loss)")
    parser.add_argument("--curriculum-steps", type=int,
                        help="ramp the training length up from 8 over this many steps (default 0: no ramp)")
    parser.add_argument("--train-length", type=int, help="parity: bits; mqar: pairs; copy: max string length")
    parser.add_argument("--min-train-length", type=int,
                        help="parity: draw every training batch's length uniformly from [this, --train-length]")
    parser.add_argument("--schedule", choices=["cosine", "onecycle"],
                        help="learning-rate schedule (default cosine: 5%% warm-up, cosine to --lr-floor)")
    parser.add_argument("--bit-density", choices=Parity.DENSITIES,
                        help="parity training strings: fair bits (half, the default), a per-string density of 1s "
                             "drawn from U(0, 1) (uniform), or every other string fair (mixed); evaluation always "
                             "uses fair bits")
    parser.add_argument("--eval-lengths", type=int, nargs="+")
    parser.add_argument("--set", nargs="*", default=[], metavar="FIELD=VALUE",
                        help="extra config fields, e.g. temperature_max=3.14159 phase_conv_size=0")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--max-seconds", type=float, default=900.0, help="safety cap on training time")
    parser.add_argument("--run", help="the run's key in benchmarks/results/synthetic.jsonl (default "
                        "<task>/<variant><tag>_seed<k>); a run with the same key is replaced")
    parser.add_argument("--tag", default="", help="suffix for the default key (e.g. a budget sweep)")
    parser.add_argument("--skip-done", action="store_true", help="do nothing when the store already has the key")
    parser.add_argument("--output", type=Path, help="write the result to this JSON file instead of the store")
    parser.add_argument("--save-model", type=Path, help="also save the trained model here (save_pretrained)")
    args = parser.parse_args(argv)
    if args.bit_density is not None and args.task != "parity":
        parser.error("--bit-density only applies to --task parity")
    if args.min_train_length is not None:
        if args.task != "parity":
            parser.error("--min-train-length only applies to --task parity")
        if args.curriculum_steps:
            parser.error("--min-train-length and --curriculum-steps both set the training length; give one")
        train_length = args.train_length or TASK_DEFAULTS["parity"]["train_length"]
        if not 1 <= args.min_train_length <= train_length:
            parser.error(f"--min-train-length must be in [1, --train-length={train_length}], "
                         f"got {args.min_train_length}")

    torch.set_num_threads(args.threads)
    key = args.run or f"{args.task}/{args.variant}{args.tag}_seed{args.seed}"
    if args.skip_done and args.output is None and key in read_runs(RESULTS):
        print(f"{key}: already in {RESULTS}, skipped", flush=True)
        return 0
    result = run(args.task, args.variant, args.seed, output=args.output, overrides=parse_overrides(args.set),
        max_seconds=args.max_seconds, save_model=args.save_model,
        family=args.family, layers=args.layers, hidden=args.hidden, heads=args.heads,
        steps=args.steps, batch=args.batch, lr=args.lr, weight_decay=args.weight_decay, lr_floor=args.lr_floor,
        label_smoothing=args.label_smoothing, curriculum_steps=args.curriculum_steps,
        train_length=args.train_length, bit_density=args.bit_density, min_train_length=args.min_train_length,
        schedule=args.schedule,
        eval_lengths=args.eval_lengths)
    if args.output is None:
        store_run(RESULTS, key, result)
        print(f"  stored {key} in {RESULTS}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
