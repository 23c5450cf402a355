"""The runs behind docs/evidence.md, parts I and II: A3 state tracking with a 2-layer Gated DeltaNet, and the MAD
recall tasks with GLA. Every run goes through :func:`train.run` (the synthetic runner's loop, one model per
(variant, seed)) in this one process, so the imports are paid once.

    python examples/synthetic/evidence.py a3  [--seeds 0 1 2]      # 6 variants x seeds
    python examples/synthetic/evidence.py mad [--seeds 0 1 2]      # 6 tasks x 3 variants x seeds
    python examples/synthetic/evidence.py mad --skip-done          # only the runs the store does not hold yet
    python examples/synthetic/evidence.py summary                  # tables (printed, and into docs/evidence.md) + plots
    python examples/synthetic/evidence.py a3 --quick               # a few seconds: 2 steps per run, into a temp store

Each run is one line of benchmarks/results/synthetic.jsonl (the synthetic runner's store, ``example_utils.store_run``;
a rerun replaces its line), keyed a3/<variant>[_negeig]_seed<k> or mad/<task>/<variant>_seed<k>; the summary's
numbers go to benchmarks/results/evidence_summary.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
for folder in (HERE, HERE.parent):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

import torch  # noqa: E402
import train  # noqa: E402
from example_utils import MarkersNotFound, read_runs, runs_below, store_run, write_between_markers  # noqa: E402
from mad import MAD_TASKS  # noqa: E402

REPO = HERE.parent.parent
RESULTS = REPO / "benchmarks" / "results" / "synthetic.jsonl"  # the synthetic runner's store (train.RESULTS)
SUMMARY = REPO / "benchmarks" / "results" / "evidence_summary.json"
DOCS = REPO / "docs"

# A3: the paper's Selective RoPE for state tracking (preset "state_tracking") against NoPE and RoPE, each with
# beta in (0, 1) and with negative eigenvalues (beta in (0, 2), Grazzi et al. 2025).
A3_VARIANTS = ("nope", "rope", "paper")
A3_BUDGET = dict(steps=300, batch=32, train_length=16, eval_lengths=[16, 32, 64])
# MAD: the paper's Table 2 base rows (its "Selective RoPE" row has neither phase gate nor bias).
MAD_VARIANTS = ("nope", "rope", "selective_plain")
MAD_BUDGET = dict(steps=150)
# The paper's Table 2 (GLA, accuracy in %), for the side-by-side table.
PAPER_MAD = {
    "nope": dict(compress=82.0, fuzzy_recall=8.5, in_context_recall=87.3, memorize=38.7, noisy_recall=87.6,
                 selective_copy=91.1),
    "rope": dict(compress=85.2, fuzzy_recall=7.5, in_context_recall=92.6, memorize=61.4, noisy_recall=91.9,
                 selective_copy=96.4),
    "selective_plain": dict(compress=85.2, fuzzy_recall=9.0, in_context_recall=94.0, memorize=57.1,
                            noisy_recall=91.7, selective_copy=94.9),
}
LABELS = {"nope": "NoPE", "rope": "RoPE", "paper": "Selective RoPE", "selective_plain": "Selective RoPE"}


def run_once(task: str, variant: str, seed: int, key: str, store: Path, quick: bool, skip_done: bool,
             **settings) -> None:
    """Train one model and put its result into ``store`` under ``key`` (replacing a run with that key); with
    ``skip_done``, a key the store already holds is not run again."""
    if skip_done and key in read_runs(store):
        return
    if quick:
        settings.update(steps=2, batch=4, eval_batch=8)
    print(f"{task} / {key}", flush=True)
    store_run(store, key, train.run(task, variant, seed, quiet=True, **settings))


def run_a3(seeds: list[int], store: Path, quick: bool, skip_done: bool) -> None:
    for seed in seeds:  # seed-major: an interrupted sweep still holds every variant at the first seeds
        for variant in A3_VARIANTS:
            for negative in (False, True):
                key = f"a3/{variant}{'_negeig' if negative else ''}_seed{seed}"
                run_once("a3", variant, seed, key, store, quick, skip_done,
                         overrides={"allow_neg_eigval": negative}, **A3_BUDGET)


def run_mad(seeds: list[int], store: Path, quick: bool, skip_done: bool) -> None:
    for seed in seeds:
        for task in MAD_TASKS:
            for variant in MAD_VARIANTS:
                run_once(task, variant, seed, f"mad/{task}/{variant}_seed{seed}", store, quick, skip_done,
                         **MAD_BUDGET)


# ------------------------------------------------------------------------------------------------------- summary

def load(runs: dict[str, dict], prefix: str) -> dict[str, list[dict]]:
    """``{group: [run, ...]}`` for the runs keyed ``<prefix><group>_seed<k>``, in key order."""
    groups: dict[str, list[dict]] = {}
    for name, run in sorted(runs_below(runs, prefix).items()):
        if "_seed" in name:
            groups.setdefault(name.rsplit("_seed", 1)[0], []).append(run)
    return groups


def metric(run: dict, length: int, name: str) -> float:
    return next(row[name] for row in run["eval"] if row["length"] == length)


def a3_table(runs: dict[str, dict]) -> tuple[str, dict]:
    groups = load(runs, "a3/")
    lengths = A3_BUDGET["eval_lengths"]
    lines = ["| model (2-layer Gated DeltaNet) | β range | seeds | " +
             " | ".join(f"final-token acc. at {n}" for n in lengths) + " | seeds ≥ 95 % at 1× / 2× |",
             "| --- | --- | --- | " + " | ".join("---" for _ in lengths) + " | --- |"]
    summary = {}
    for variant in A3_VARIANTS:
        for negative in (False, True):
            runs = groups.get(f"{variant}{'_negeig' if negative else ''}", [])
            if not runs:
                continue
            cells, row = [], {}
            for n in lengths:
                values = [100 * metric(r, n, "final_token_accuracy") for r in runs]
                row[n] = values
                cells.append(f"{statistics.mean(values):.1f} ({min(values):.0f}–{max(values):.0f})")
            hits = [sum(v >= 95 for v in row[n]) for n in lengths[:2]]
            summary[f"{variant}{'_negeig' if negative else ''}"] = row
            lines.append(f"| {LABELS[variant]} | {'(0, 2)' if negative else '(0, 1)'} | {len(runs)} | "
                         + " | ".join(cells) + f" | {hits[0]}/{len(runs)} / {hits[1]}/{len(runs)} |")
    return "\n".join(lines), summary


def mad_table(runs: dict[str, dict]) -> tuple[str, dict]:
    tasks = list(MAD_TASKS)
    header = "| model (GLA) | " + " | ".join(t.replace("_", " ") for t in tasks) + " | average |"
    lines = [header, "| --- |" + " --- |" * (len(tasks) + 1)]
    summary = {}
    for variant in MAD_VARIANTS:
        ours = []
        for task in tasks:
            seeds = load(runs, f"mad/{task}/").get(variant, [])
            ours.append([100 * r["eval"][0]["token_accuracy"] for r in seeds])
        if not any(ours):
            continue
        means = [statistics.mean(v) if v else None for v in ours]
        summary[variant] = {t: v for t, v in zip(tasks, ours)}
        paper = [PAPER_MAD[variant][t] for t in tasks]
        counts = sorted(len(v) for v in ours if v)
        seed_note = f"{counts[0]}" if counts[0] == counts[-1] else f"{counts[0]}–{counts[-1]}"
        lines.append(f"| {LABELS[variant]}, here ({seed_note} seeds) | "
                     + " | ".join(f"{m:.1f} ({min(v):.1f}–{max(v):.1f})" if v else "—" for m, v in zip(means, ours))
                     + (f" | {statistics.mean(means):.1f} |" if all(v for v in ours) else " | — |"))
        lines.append(f"| {LABELS[variant]}, paper | " + " | ".join(f"{p:.1f}" for p in paper)
                     + f" | {statistics.mean(paper):.1f} |")
    return "\n".join(lines), summary


def plots(a3: dict, mad: dict, docs: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if a3:
        fig, ax = plt.subplots(figsize=(5, 3.2), dpi=100)
        lengths = A3_BUDGET["eval_lengths"]
        for name, row in a3.items():
            variant = name.replace("_negeig", "")
            mean = [statistics.mean(row[n]) for n in lengths]
            ax.plot(lengths, mean, marker="o", linestyle="--" if "_negeig" in name else "-",
                    color=f"C{A3_VARIANTS.index(variant)}",
                    label=f"{LABELS[variant]}{', β∈(0,2)' if '_negeig' in name else ''}")
        ax.axvline(A3_BUDGET["train_length"], color="grey", linestyle=":", linewidth=1)
        ax.axhline(100 / 3, color="grey", linestyle="-.", linewidth=0.8)  # chance
        ax.set_xscale("log")
        ax.minorticks_off()
        ax.set(xticks=lengths, xticklabels=[str(n) for n in lengths], ylim=(0, 102),
               xlabel="word length (elements of A3)", ylabel="final-token accuracy (%)",
               title="A3, 2-layer Gated DeltaNet (mean over seeds)")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(docs / "evidence_a3.png")
        plt.close(fig)
    if mad:
        tasks = list(MAD_TASKS)
        fig, ax = plt.subplots(figsize=(6.5, 3), dpi=100)
        width = 0.8 / len(mad)
        for i, (variant, row) in enumerate(mad.items()):
            means = [statistics.mean(row[t]) if row[t] else 0 for t in tasks]
            ax.bar([j + i * width for j in range(len(tasks))], means, width, label=LABELS[variant])
            ax.scatter([j + i * width for j in range(len(tasks))], [PAPER_MAD[variant][t] for t in tasks],
                       marker="_", color="black", s=60, zorder=3)
        ax.set_xticks([j + width * (len(mad) - 1) / 2 for j in range(len(tasks))])
        ax.set_xticklabels([t.replace("_", "\n") for t in tasks], fontsize=7)
        ax.set(ylabel="accuracy (%)", ylim=(0, 100), title="MAD recall tasks, GLA (bars: here; dashes: paper)")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(docs / "evidence_mad.png")
        plt.close(fig)


def summarize(results: Path, summary: Path, docs: Path, make_plots: bool) -> None:
    runs = read_runs(results)
    a3_markdown, a3 = a3_table(runs)
    mad_markdown, mad = mad_table(runs)
    for key, markdown in (("a3", a3_markdown), ("mad", mad_markdown)):
        print(markdown + "\n")
        try:
            write_between_markers(docs / "evidence.md", f"<!-- results:{key}:start -->", f"<!-- results:{key}:end -->",
                                  markdown)
        except (FileNotFoundError, MarkersNotFound):
            pass
    summary.write_text(json.dumps({"a3": a3, "mad": mad}, indent=1) + "\n")
    if make_plots:
        plots(a3, mad, docs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("section", choices=["a3", "mad", "summary"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--results", type=Path, default=RESULTS, help="the runs' JSON Lines store")
    parser.add_argument("--summary", type=Path, default=SUMMARY, help="where the summary JSON goes")
    parser.add_argument("--skip-done", action="store_true", help="run only the keys the store does not hold yet")
    parser.add_argument("--docs", type=Path, default=DOCS)
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--quick", action="store_true",
                        help="2 steps per run at batch 4, one seed, into a temporary store (a smoke test)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.section == "summary":
        summarize(args.results, args.summary, args.docs, not args.no_plots)
        return 0
    runner = run_a3 if args.section == "a3" else run_mad
    if args.quick:
        with tempfile.TemporaryDirectory() as folder:
            store = Path(folder) / "synthetic.jsonl"
            runner(args.seeds[:1], store, quick=True, skip_done=False)
            count = len(read_runs(store))
        print(f"quick: {count} runs")
        return 0
    runner(args.seeds, args.results, quick=False, skip_done=args.skip_done)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
