"""Language modelling on real text at CPU scale: the Python standard library's own source files.

    python examples/lm/train_lm.py prepare                       # split by file, train the BPE tokenizer, encode
    python examples/lm/train_lm.py train --family gla --variant selective --seed 0

No data is downloaded: the corpus is every ``.py`` file under ``sysconfig.get_paths()["stdlib"]`` (without
``site-packages`` and the test suites), which every Python installation carries. Files, not tokens, are split into
training and held-out sets (a file is held out when the SHA-1 of its relative path falls in the held-out fraction),
so no held-out text was ever seen in training, not even a neighbouring chunk of the same file. A byte-level BPE
tokenizer (the ``tokenizers`` library) is trained on the training files only.

Every model is trained with the same budget (``--steps`` batches of ``--batch`` random windows of ``--length``
tokens) and evaluated on the same held-out tokens cut into non-overlapping windows of 1x, 2x and 4x the training
length; each window starts with an empty state, so a longer window is a longer context, and the perplexity at 2x and
4x says whether the model uses (or is at least not hurt by) context longer than it was trained on. The JSON also
holds the perplexity of the positions past the training length only (``beyond_train_length``), where a model that
fails to extrapolate shows it first.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import sys
import sysconfig
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:  # examples/: example_utils.py, the helpers the example scripts share
    sys.path.insert(0, str(HERE.parent))

from example_utils import lr_at, read_runs, store_run  # noqa: E402

REPO = HERE.parent.parent
RESULTS = REPO / "benchmarks" / "results" / "lm.jsonl"  # every run, one line each, keyed by --run
CACHE = HERE / ".cache"  # tokenizer and encoded corpus (ignored by git; `prepare` rebuilds them)

EOS = "<|endoftext|>"  # separates files in the token stream

# The position embedding of every mixer; everything else is identical between variants.
VARIANTS = {
    "nope": dict(position_embedding="nope"),
    "rope": dict(position_embedding="rope"),
    "selective": dict(position_embedding="selective_rope", phase_gate=True, phase_bias=False),  # library default
    "selective_bias": dict(position_embedding="selective_rope", phase_gate=False, phase_bias=True),
    "selective_gate_bias": dict(position_embedding="selective_rope", phase_gate=True, phase_bias=True),
}
FAMILIES = ("gla", "gated_deltanet", "fox")

DEFAULTS = dict(vocab_size=2048, held_out_fraction=0.1, hidden=128, layers=2, heads=4, length=128, batch=16,
                steps=400, lr=3e-3, eval_windows=48, eval_multiples=(1, 2, 4))


# ------------------------------------------------------------------------------------------------------------ data

def stdlib_files(root: Path | None = None) -> list[Path]:
    """Every ``.py`` file of the standard library except ``site-packages`` and the test suites, sorted."""
    root = Path(sysconfig.get_paths()["stdlib"]) if root is None else Path(root)
    excluded = {"site-packages", "test", "tests"}
    files = [path for path in root.rglob("*.py") if not excluded & set(path.relative_to(root).parts)]
    if not files:
        raise FileNotFoundError(f"no .py files under {root}")
    return sorted(files)


def is_held_out(relative_path: str, fraction: float) -> bool:
    """Whether a file belongs to the held-out set: a fixed function of its relative path (not of the machine)."""
    if not 0 < fraction < 1:
        raise ValueError(f"held_out_fraction must be in (0, 1), got {fraction}")
    digest = hashlib.sha1(relative_path.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def split_by_file(files: list[Path], root: Path, fraction: float) -> tuple[list[Path], list[Path]]:
    """(training files, held-out files): every file in exactly one of them."""
    train, held_out = [], []
    for path in files:
        (held_out if is_held_out(path.relative_to(root).as_posix(), fraction) else train).append(path)
    if not train or not held_out:
        raise ValueError(f"the split of {len(files)} files left one side empty (fraction {fraction})")
    return train, held_out


def read_texts(files: list[Path]) -> list[str]:
    return [path.read_text(encoding="utf-8", errors="replace") for path in files]


def train_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE tokenizer trained on ``texts`` (the training files only), with ``EOS`` as a special token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def encode(tokenizer, texts: list[str]) -> torch.Tensor:
    """One token stream: every text followed by ``EOS``. (N,) int32."""
    eos = tokenizer.token_to_id(EOS)
    ids = []
    for encoding in tokenizer.encode_batch(texts):
        ids.extend(encoding.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.int32)


def prepare(cache: Path = CACHE, vocab_size: int = DEFAULTS["vocab_size"],
            held_out_fraction: float = DEFAULTS["held_out_fraction"], root: Path | None = None) -> dict:
    """Split, train the tokenizer, encode both sides; writes ``cache`` and returns the corpus summary."""
    root = Path(sysconfig.get_paths()["stdlib"]) if root is None else Path(root)
    train_files, held_out_files = split_by_file(stdlib_files(root), root, held_out_fraction)
    train_texts, held_out_texts = read_texts(train_files), read_texts(held_out_files)
    tokenizer = train_tokenizer(train_texts, vocab_size)
    train_ids, held_out_ids = encode(tokenizer, train_texts), encode(tokenizer, held_out_texts)
    cache.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(cache / "tokenizer.json"))
    torch.save({"train": train_ids, "held_out": held_out_ids}, cache / "tokens.pt")
    summary = {
        "root": str(root), "python": platform.python_version(), "held_out_fraction": held_out_fraction,
        "vocab_size": tokenizer.get_vocab_size(),
        "train_files": len(train_files), "held_out_files": len(held_out_files),
        "train_bytes": sum(len(t.encode()) for t in train_texts),
        "held_out_bytes": sum(len(t.encode()) for t in held_out_texts),
        "train_tokens": int(train_ids.numel()), "held_out_tokens": int(held_out_ids.numel()),
        "held_out_file_list": [path.relative_to(root).as_posix() for path in held_out_files],
    }
    (cache / "corpus.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


# ----------------------------------------------------------------------------------------------------------- model

def build_config(family: str, variant: str, vocab_size: int, hidden: int, layers: int, heads: int):
    from selective_rope import SelectiveRopeFoXConfig, SelectiveRopeGatedDeltaNetConfig, SelectiveRopeGLAConfig

    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; expected one of {list(VARIANTS)}")
    common = dict(vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers, intermediate_size=4 * hidden,
                  bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=True,
                  **VARIANTS[variant])
    if family == "gla":
        return SelectiveRopeGLAConfig(**common, num_heads=heads, expand_k=1.0, expand_v=1.0, use_short_conv=True)
    if family == "gated_deltanet":
        return SelectiveRopeGatedDeltaNetConfig(**common, num_heads=heads, head_dim=hidden // heads, expand_v=1.0,
                                                use_short_conv=True)
    if family == "fox":
        return SelectiveRopeFoXConfig(**common, num_attention_heads=heads, num_key_value_heads=heads)
    raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")


# ------------------------------------------------------------------------------------------------------ evaluation

def windows(ids: torch.Tensor, length: int, count: int) -> torch.Tensor:
    """The first ``count`` non-overlapping windows of ``length`` tokens. (count, length) long."""
    if ids.numel() < length * count:
        raise ValueError(f"{count} windows of {length} tokens need {length * count} tokens, have {ids.numel()}")
    return ids[: length * count].long().view(count, length)


@torch.no_grad()
def window_nll(model, batch: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood of every predicted token, each window from an empty state. (B, T - 1) float."""
    logits = model(batch).logits.float()  # (B, T, V)
    return torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), batch[:, 1:], reduction="none")


@torch.no_grad()
def perplexity(model, ids: torch.Tensor, length: int, count: int, train_length: int, chunk: int = 16) -> dict:
    """Held-out perplexity over ``count`` windows of ``length`` tokens; also over the predicted positions at or past
    ``train_length`` (a position ``t`` predicts token ``t + 1`` from ``t + 1`` tokens of context)."""
    data = windows(ids, length, count)
    nll = torch.cat([window_nll(model, data[i: i + chunk]) for i in range(0, count, chunk)])  # (count, length - 1)
    result = {"length": length, "windows": count, "predicted_tokens": nll.numel(),
              "nll": nll.mean().item(), "perplexity": math.exp(nll.mean().item())}
    if length > train_length:
        beyond = nll[:, train_length - 1:]  # predictions made with more context than any training window had
        result["beyond_train_length"] = {"predicted_tokens": beyond.numel(), "nll": beyond.mean().item(),
                                         "perplexity": math.exp(beyond.mean().item())}
    return result


# -------------------------------------------------------------------------------------------------------- training

def train(model, ids: torch.Tensor, settings: dict, seed: int, log_every: int = 50) -> dict:
    """AdamW on random windows of the training stream (the same windows for every model with the same seed)."""
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings["lr"], weight_decay=0.1, betas=(0.9, 0.95))
    length, batch, steps = settings["length"], settings["batch"], settings["steps"]
    curve, losses, start = [], [], time.perf_counter()
    model.train()
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, steps, settings["lr"])
        offsets = torch.randint(0, ids.numel() - length, (batch,), generator=generator)
        data = torch.stack([ids[o: o + length] for o in offsets.tolist()]).long()  # (batch, length)
        loss = model(data, labels=data).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        if (step + 1) % log_every == 0 or step == steps - 1:
            curve.append({"step": step + 1, "loss": sum(losses) / len(losses),
                          "seconds": time.perf_counter() - start})
            print(f"  step {step + 1:5d}  loss {curve[-1]['loss']:.4f}  {curve[-1]['seconds']:6.1f}s", flush=True)
            losses = []
    model.eval()
    return {"loss_curve": curve, "train_seconds": time.perf_counter() - start}


def run(family: str, variant: str, seed: int, cache: Path = CACHE, output: Path | None = None, **overrides) -> dict:
    import transformers
    from transformers import AutoModelForCausalLM

    import selective_rope  # noqa: F401  (registers the Auto classes)

    settings = dict(DEFAULTS, **{k: v for k, v in overrides.items() if v is not None})
    if not (cache / "tokens.pt").exists():
        raise FileNotFoundError(f"{cache / 'tokens.pt'} is missing: run `python {Path(__file__).name} prepare` first")
    tokens = torch.load(cache / "tokens.pt")
    corpus = json.loads((cache / "corpus.json").read_text())
    torch.manual_seed(seed)
    config = build_config(family, variant, corpus["vocab_size"], settings["hidden"], settings["layers"],
                          settings["heads"])
    model = AutoModelForCausalLM.from_config(config)
    parameters = sum(p.numel() for p in model.parameters())
    print(f"lm / {family} / {variant} / seed {seed}: {parameters:,} parameters", flush=True)
    training = train(model, tokens["train"], settings, seed)
    start = time.perf_counter()
    length, count = settings["length"], settings["eval_windows"]
    # The same held-out tokens at every window length: count * max_multiple windows of `length` tokens.
    most = max(settings["eval_multiples"])
    evaluation = [perplexity(model, tokens["held_out"], length * m, count * most // m, length)
                  for m in settings["eval_multiples"]]
    for row in evaluation:
        beyond = row.get("beyond_train_length")
        extra = f"  beyond train length {beyond['perplexity']:.2f}" if beyond else ""
        print(f"  held-out ppl @ {row['length']:5d}: {row['perplexity']:.2f}{extra}", flush=True)
    result = {
        "family": family, "variant": variant, "variant_fields": VARIANTS[variant], "seed": seed,
        "settings": {k: (list(v) if isinstance(v, tuple) else v) for k, v in settings.items()},
        "parameters": parameters, "model_config": config.to_diff_dict(),
        "corpus": {k: v for k, v in corpus.items() if k != "held_out_file_list"},
        "eval": evaluation, "final_train_loss": training["loss_curve"][-1]["loss"],
        "loss_curve": training["loss_curve"], "train_seconds": training["train_seconds"],
        "eval_seconds": time.perf_counter() - start,
        "torch_version": torch.__version__, "transformers_version": transformers.__version__,
        "machine": {"platform": platform.platform(), "torch_threads": torch.get_num_threads(),
                    "loadavg_at_end": list(os.getloadavg())},
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]) if sys.argv else None,
    }
    if output is not None:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(json.dumps(result, indent=1) + "\n")
        print(f"  wrote {output}", flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache", type=Path, default=CACHE, help="tokenizer and encoded corpus (default %(default)s)")
    commands = parser.add_subparsers(dest="command", required=True)
    prep = commands.add_parser("prepare", help="split the stdlib by file, train the tokenizer, encode")
    prep.add_argument("--vocab-size", type=int, default=DEFAULTS["vocab_size"])
    prep.add_argument("--held-out-fraction", type=float, default=DEFAULTS["held_out_fraction"])
    fit = commands.add_parser("train", help="train one model and write its results JSON")
    fit.add_argument("--family", choices=FAMILIES, required=True)
    fit.add_argument("--variant", choices=list(VARIANTS), required=True)
    fit.add_argument("--seed", type=int, default=0)
    for name in ("hidden", "layers", "heads", "length", "batch", "steps", "eval_windows"):
        fit.add_argument(f"--{name.replace('_', '-')}", type=int, help=f"default {DEFAULTS[name]}")
    fit.add_argument("--lr", type=float, help=f"default {DEFAULTS['lr']}")
    fit.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    fit.add_argument("--run", help="the run's key in benchmarks/results/lm.jsonl (default <family>/<variant>_seed<k>); "
                                   "a run with the same key is replaced")
    fit.add_argument("--skip-done", action="store_true", help="do nothing when the store already has the key")
    fit.add_argument("--output", type=Path, help="write the result to this JSON file instead of the store")
    args = parser.parse_args(argv)
    if args.command == "prepare":
        summary = prepare(args.cache, args.vocab_size, args.held_out_fraction)
        print(json.dumps({k: v for k, v in summary.items() if k != "held_out_file_list"}, indent=1))
        return 0
    torch.set_num_threads(args.threads)
    key = args.run or f"{args.family}/{args.variant}_seed{args.seed}"
    if args.skip_done and args.output is None and key in read_runs(RESULTS):
        print(f"{key}: already in {RESULTS}, skipped", flush=True)
        return 0
    result = run(args.family, args.variant, args.seed, cache=args.cache, output=args.output, hidden=args.hidden,
                 layers=args.layers, heads=args.heads, length=args.length, batch=args.batch, steps=args.steps,
                 eval_windows=args.eval_windows, lr=args.lr)
    if args.output is None:
        store_run(RESULTS, key, result)
        print(f"  stored {key} in {RESULTS}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
