"""What a retrofit buys: pretrain a tiny Llama (transformers' ``LlamaForCausalLM``, RoPE) on the standard-library
corpus of ``train_lm.py``, convert it with ``selective-rope convert`` (FoX with Selective RoPE, with and without the
FoX forget gate), fine-tune the converted models and the original for the same steps on the same windows, and compare
held-out perplexity at 1x, 2x and 4x the training context.

    python examples/lm/train_lm.py prepare        # once: the tokenizer and the encoded corpus
    python examples/lm/retrofit.py run --seeds 0 1 2
    python examples/lm/retrofit.py run --skip-done # only the fine-tuning runs the store does not hold yet
    python examples/lm/retrofit.py summary        # table (printed, into docs/evidence.md), docs/evidence_retrofit.png
    python examples/lm/retrofit.py run --quick    # a few seconds: a tiny corpus, 2 steps each, in a temporary folder

Arms (every one fine-tuned with the same windows, steps and learning rate for a given seed):

    llama              the pretrained Llama itself (RoPE)
    selective          ``selective-rope convert --no-forget-gate``: softmax attention, Selective RoPE
    selective_forget   ``selective-rope convert``: the FoX forget gate (starting at "no forgetting") and Selective RoPE
    selective_forget_bias4
                       the same with ``--forget-gate-bias 4`` (log f = -0.018 per token: it forgets from the start,
                       so it does not start exact; ``--tolerance 1`` lets the converter write it)

Each converted model but the last starts computing exactly what the Llama computes (the converter checks it on a probe
batch); each run also records the perplexity of every arm before fine-tuning, equal across those arms.
Files: the pretrained and converted models under ``examples/lm/.cache/retrofit/`` (ignored by git). Results: one line
per run in ``benchmarks/results/retrofit.jsonl`` (``example_utils.store_run``; a rerun replaces its line), keyed
``pretrain`` and ``<arm>_seed<k>``; the summary's numbers in ``benchmarks/results/retrofit_summary.json``. The
pretrained Llama is trained once: kept while its model is saved and the store holds ``pretrain``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
for folder in (HERE, HERE.parent):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

import train_lm  # noqa: E402
from example_utils import MarkersNotFound, read_runs, store_run, write_between_markers  # noqa: E402

REPO = HERE.parent.parent
RESULTS = REPO / "benchmarks" / "results" / "retrofit.jsonl"  # every run, one line each
SUMMARY = REPO / "benchmarks" / "results" / "retrofit_summary.json"
MODELS = train_lm.CACHE / "retrofit"
DOCS = REPO / "docs"

ARMS = {"llama": None, "selective": ["--no-forget-gate"], "selective_forget": [],  # arm -> convert flags
        "selective_forget_bias4": ["--forget-gate-bias", "4", "--tolerance", "1"]}
LABELS = {"llama": "Llama (RoPE)", "selective": "converted: Selective RoPE",
          "selective_forget": "converted: Selective RoPE + forget gate",
          "selective_forget_bias4": "converted: Selective RoPE + forget gate, bias 4 (not exact at start)"}
SETTINGS = dict(hidden=64, layers=2, heads=2, length=256, batch=8, pretrain_steps=1000, pretrain_lr=3e-3,
                finetune_steps=200, finetune_lr=1e-3, eval_windows=16, eval_multiples=(1, 2, 4))
QUICK = dict(SETTINGS, hidden=32, length=16, batch=2, pretrain_steps=2, finetune_steps=2, eval_windows=2)


def llama_config(vocab_size: int, settings: dict):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab_size, hidden_size=settings["hidden"], num_hidden_layers=settings["layers"],
                       num_attention_heads=settings["heads"], num_key_value_heads=settings["heads"],
                       intermediate_size=4 * settings["hidden"], max_position_embeddings=8 * settings["length"],
                       tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, pad_token_id=None)


def evaluate(model, held_out: torch.Tensor, settings: dict) -> list[dict]:
    """Perplexity over the same held-out tokens at every multiple of the training context (``train_lm.perplexity``)."""
    length, most = settings["length"], max(settings["eval_multiples"])
    return [train_lm.perplexity(model, held_out, length * m, settings["eval_windows"] * most // m, length)
            for m in settings["eval_multiples"]]


def describe(rows: list[dict]) -> str:
    return "  ".join(f"ppl@{row['length']} {row['perplexity']:.2f}" for row in rows)


def pretrain(tokens: dict, vocab_size: int, settings: dict, models: Path, store: Path) -> Path:
    """Train the Llama from scratch (seed 0) and save it; skipped when it is saved and ``store`` holds its run."""
    from transformers import LlamaForCausalLM

    source = models / "llama"
    if (source / "config.json").exists() and "pretrain" in read_runs(store):
        return source
    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config(vocab_size, settings))
    print(f"pretrain Llama: {sum(p.numel() for p in model.parameters()):,} parameters", flush=True)
    run = dict(settings, steps=settings["pretrain_steps"], lr=settings["pretrain_lr"])
    training = train_lm.train(model, tokens["train"], run, seed=0)
    rows = evaluate(model, tokens["held_out"], settings)
    print(f"  pretrained: {describe(rows)}", flush=True)
    model.save_pretrained(source)
    store_run(store, "pretrain", {"model": "LlamaForCausalLM", "config": model.config.to_diff_dict(),
                        "settings": jsonable(settings), "eval": rows, "loss_curve": training["loss_curve"],
                        "train_seconds": training["train_seconds"], **environment()})
    return source


def convert(source: Path, models: Path, arms: list[str]) -> dict[str, Path]:
    """``selective-rope convert`` once per converted arm (the command-line tool itself, as a user runs it)."""
    from selective_rope.cli import main as cli_main
    paths = {"llama": source}
    for arm in arms:
        flags = ARMS[arm]
        if flags is None:
            continue
        paths[arm] = models / arm
        if (paths[arm] / "config.json").exists():
            continue
        command = ["convert", str(source), str(paths[arm]), "--license", "mit", "--no-progress", *flags]
        print("selective-rope " + " ".join(command), flush=True)
        if cli_main(command) != 0:  # the command-line tool's own entry point, in this process
            raise SystemExit(f"selective-rope {' '.join(command)} failed")
    return paths


def finetune(arm: str, path: Path, seed: int, tokens: dict, settings: dict, store: Path, skip_done: bool) -> None:
    from transformers import AutoModelForCausalLM

    import selective_rope  # noqa: F401  (registers the Auto classes)

    key = f"{arm}_seed{seed}"
    if skip_done and key in read_runs(store):
        return
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    before = evaluate(model, tokens["held_out"], settings)
    run = dict(settings, steps=settings["finetune_steps"], lr=settings["finetune_lr"])
    # seed 1000 + k: windows no pretraining batch was drawn with, the same for every arm at seed k
    training = train_lm.train(model, tokens["train"], run, seed=1000 + seed)
    after = evaluate(model, tokens["held_out"], settings)
    print(f"  {arm} seed {seed}: before {describe(before)}\n  {' ' * len(arm)}         after  {describe(after)}",
          flush=True)
    store_run(store, key, {"arm": arm, "seed": seed, "model": type(model).__name__,
                        "parameters": sum(p.numel() for p in model.parameters()),
                        "config": model.config.to_diff_dict(), "settings": jsonable(settings),
                        "eval_before": before, "eval": after, "loss_curve": training["loss_curve"],
                        "train_seconds": training["train_seconds"], **environment()})


def run(seeds: list[int], cache: Path, models: Path, store: Path, settings: dict,
        arms: list[str] | None = None, skip_done: bool = False) -> None:
    arms = list(ARMS) if arms is None else arms
    if not (cache / "tokens.pt").exists():
        raise SystemExit(f"{cache / 'tokens.pt'} is missing: run `python examples/lm/train_lm.py prepare` first")
    tokens = torch.load(cache / "tokens.pt")
    vocab_size = json.loads((cache / "corpus.json").read_text())["vocab_size"]
    source = pretrain(tokens, vocab_size, settings, models, store)
    paths = convert(source, models, arms)
    for seed in seeds:
        for arm in arms:
            finetune(arm, paths[arm], seed, tokens, settings, store, skip_done)


# ------------------------------------------------------------------------------------------------------- summary

def summarize(store: Path, summary_path: Path, docs: Path, make_plots: bool) -> None:
    stored = read_runs(store)
    runs: dict[str, list[dict]] = {}
    for key, record in sorted(stored.items()):
        if "_seed" in key:
            runs.setdefault(record["arm"], []).append(record)
    if not runs or "pretrain" not in stored:
        raise SystemExit(f"{store} holds no pretraining run or no fine-tuning runs: run `retrofit.py run` first")
    pretrained = stored["pretrain"]
    lengths = [row["length"] for row in pretrained["eval"]]
    lines = ["| model | seeds | " + " | ".join(f"ppl at {n}" for n in lengths) + " | Δ vs Llama at "
             + " / ".join(str(n) for n in lengths) + " (paired by seed) |",
             "| --- | --- |" + " --- |" * (len(lengths) + 1),
             "| pretrained Llama, before fine-tuning (= every exact conversion) | — | "
             + " | ".join(f"{row['perplexity']:.2f}" for row in pretrained["eval"]) + " | — |"]
    summary = {"pretrained": {row["length"]: row["perplexity"] for row in pretrained["eval"]}}
    baseline = {r["seed"]: r for r in runs.get("llama", [])}
    for arm in ARMS:
        if arm not in runs:
            continue
        per_length = {n: [next(e["perplexity"] for e in r["eval"] if e["length"] == n) for r in runs[arm]]
                      for n in lengths}
        deltas = {n: [next(e["perplexity"] for e in r["eval"] if e["length"] == n)
                      - next(e["perplexity"] for e in baseline[r["seed"]]["eval"] if e["length"] == n)
                      for r in runs[arm] if r["seed"] in baseline] for n in lengths}
        summary[arm] = {"perplexity": per_length, "delta_vs_llama": deltas}
        cells = [f"{statistics.mean(v):.2f} ({min(v):.2f}–{max(v):.2f})" for v in per_length.values()]
        delta = " / ".join(f"{statistics.mean(d):+.2f}" if d else "—" for d in deltas.values())
        lines.append(f"| {LABELS[arm]}, fine-tuned | {len(runs[arm])} | " + " | ".join(cells)
                     + f" | {delta if arm != 'llama' else '—'} |")
    markdown = "\n".join(lines)
    print(markdown)
    try:
        write_between_markers(docs / "evidence.md", "<!-- results:retrofit:start -->",
                              "<!-- results:retrofit:end -->", markdown)
    except (FileNotFoundError, MarkersNotFound):
        pass
    write_json(summary_path, summary)
    if make_plots:
        plot(summary, lengths, pretrained["settings"]["length"], docs / "evidence_retrofit.png")


def plot(summary: dict, lengths: list[int], train_length: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.2), dpi=100)
    ax.plot(lengths, [summary["pretrained"][n] for n in lengths], color="grey", linestyle=":", marker="x",
            label="pretrained Llama (no fine-tuning)")
    for arm in ARMS:
        if arm in summary:
            values = summary[arm]["perplexity"]
            ax.errorbar(lengths, [statistics.mean(values[n]) for n in lengths],
                        yerr=[[statistics.mean(values[n]) - min(values[n]) for n in lengths],
                              [max(values[n]) - statistics.mean(values[n]) for n in lengths]],
                        marker="o", capsize=3, label=f"{LABELS[arm]}, fine-tuned")
    ax.axvline(train_length, color="grey", linestyle=":", linewidth=1)
    ax.set_xscale("log")
    ax.minorticks_off()
    ax.set(xticks=lengths, xticklabels=[str(n) for n in lengths],
           xlabel="context (tokens; training context dotted)", ylabel="held-out perplexity",
           title="Retrofit: Llama vs its Selective RoPE conversions")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# ------------------------------------------------------------------------------------------------------- helpers

def jsonable(settings: dict) -> dict:
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in settings.items()}


def environment() -> dict:
    import transformers

    return {"torch_version": torch.__version__, "transformers_version": transformers.__version__,
            "torch_threads": torch.get_num_threads(), "loadavg_at_end": list(os.getloadavg()),
            "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def write_json(path: Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")


def quick() -> None:
    """Every step at toy size on a tiny corpus of this repository's own example files, in a temporary folder."""
    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        corpus = folder / "corpus"
        corpus.mkdir()
        for path in sorted(HERE.parent.rglob("*.py"))[:12]:  # enough text for a 300-token tokenizer
            (corpus / path.name).write_text(path.read_text())
        train_lm.prepare(folder / "cache", vocab_size=300, held_out_fraction=0.3, root=corpus)
        run([0], folder / "cache", folder / "models", folder / "retrofit.jsonl", QUICK)
        summarize(folder / "retrofit.jsonl", folder / "summary.json", folder, make_plots=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["run", "summary"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), help="run only these arms (default: all)")
    parser.add_argument("--skip-done", action="store_true",
                        help="run: only the fine-tuning runs the store does not hold yet")
    parser.add_argument("--quick", action="store_true", help="run: every step at toy size in a temporary folder")
    parser.add_argument("--no-plots", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.command == "summary":
        summarize(RESULTS, SUMMARY, DOCS, not args.no_plots)
    elif args.quick:
        quick()
    else:
        run(args.seeds, train_lm.CACHE, MODELS, RESULTS, SETTINGS, args.arms, args.skip_done)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
