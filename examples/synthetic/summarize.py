"""Summarise the synthetic-task results: markdown tables (printed, and written into docs/synthetic.md between the
``<!-- results:<task>:start -->`` / ``<!-- results:<task>:end -->`` markers when they are there) and one plot per
task (accuracy vs test length per variant, mean over seeds with the min-max band).

    python examples/synthetic/summarize.py [--results benchmarks/results/synthetic] [--docs docs] [--no-plots]

matplotlib is imported only by the plotting step (``pip install matplotlib``); ``--no-plots`` needs none.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
RESULTS = REPO / "benchmarks" / "results" / "synthetic"
DOCS = REPO / "docs"

# The headline metric of each task, and the secondary one shown next to it.
METRICS = {
    "parity": ("final_token_accuracy", "token_accuracy"),
    "mqar": ("token_accuracy", "sequence_accuracy"),
    "copy": ("sequence_accuracy", "token_accuracy"),
}
METRIC_NAMES = {"final_token_accuracy": "final-token accuracy", "token_accuracy": "token accuracy",
                "sequence_accuracy": "sequence accuracy"}
ORDER = ["nope", "rope", "selective", "selective_plain", "selective_bias", "selective_gate_bias"]
LABELS = {"nope": "NoPE", "rope": "RoPE", "selective": "Selective RoPE (gate)",
          "selective_plain": "Selective RoPE (no gate, no bias)", "selective_bias": "Selective RoPE (bias)",
          "selective_gate_bias": "Selective RoPE (gate + bias)"}
SEED_FILE = re.compile(r"^(?P<group>.+)_seed(?P<seed>\d+)\.json$")


def load(results: Path = RESULTS) -> dict[str, dict[str, list[dict]]]:
    """``{task: {group: [run, ...]}}``; the group is the file name without ``_seed<k>.json``."""
    runs: dict[str, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for path in sorted(results.glob("*/*.json")):
        match = SEED_FILE.match(path.name)
        if not match:
            continue
        run = json.loads(path.read_text())
        runs[run["task"]][match["group"]].append(run)
    return runs


def group_label(group: str) -> str:
    for variant in sorted(ORDER, key=len, reverse=True):
        if group == variant or group.startswith(variant + "_"):
            rest = group[len(variant):].lstrip("_")
            return LABELS[variant] + (f" [{rest}]" if rest else "")
    return group


def group_key(group: str) -> tuple:
    base = next((v for v in sorted(ORDER, key=len, reverse=True) if group == v or group.startswith(v + "_")), group)
    rest = group[len(base):]
    steps = re.search(r"steps(\d+)", rest)
    return (ORDER.index(base) if base in ORDER else len(ORDER), bool(rest), re.sub(r"\d+", "", rest),
            int(steps[1]) if steps else 0, rest)


def aggregate(runs: list[dict], metric: str) -> dict[int, list[float]]:
    """``{test length: [value per seed]}``."""
    values: dict[int, list[float]] = defaultdict(list)
    for run in runs:
        for row in run["eval"]:
            if metric in row:
                values[row["length"]].append(row[metric])
    return dict(sorted(values.items()))


def fmt(values: list[float]) -> str:
    mean = 100 * statistics.fmean(values)
    if len(values) == 1:
        return f"{mean:.1f}"
    return f"{mean:.1f} ({100 * min(values):.0f}–{100 * max(values):.0f})"


def table(task: str, groups: dict[str, list[dict]], metric: str) -> str:
    """Markdown table: one row per group, one column per test length, mean (min–max) over seeds, in %."""
    lengths = sorted({row["length"] for runs in groups.values() for run in runs for row in run["eval"]})
    any_run = next(iter(next(iter(groups.values()))))
    train_length = any_run["budget"]["train_length"]
    header = [f"{length}{' (train)' if length == train_length else ''}" for length in lengths]
    lines = [f"| variant | seeds | steps × batch | train s | {' | '.join(header)} |",
             "| --- | --- | --- | --- | " + " | ".join("---" for _ in lengths) + " |"]
    for group in sorted(groups, key=group_key):
        runs = groups[group]
        values = aggregate(runs, metric)
        budget = runs[0]["budget"]
        seconds = statistics.fmean(r["train_seconds"] for r in runs)
        cells = [fmt(values[length]) if length in values else "—" for length in lengths]
        seeds = ",".join(str(r["seed"]) for r in sorted(runs, key=lambda r: r["seed"]))
        lines.append(f"| {group_label(group)} | {seeds} | {budget['steps']} × {budget['batch']} | {seconds:.0f} | "
                     f"{' | '.join(cells)} |")
    return "\n".join(lines)


def task_tables(task: str, groups: dict[str, list[dict]]) -> str:
    unit = next(iter(groups.values()))[0]["length_unit"]
    parts = []
    for metric in METRICS[task]:
        parts.append(f"{METRIC_NAMES[metric]} (%) by test length ({unit}); mean over seeds (min–max):\n\n"
                     + table(task, groups, metric))
    return "\n\n".join(parts)


def plot(task: str, groups: dict[str, list[dict]], output: Path) -> Path:
    """Accuracy vs test length, one line per main group (no tag, or a family tag), mean with the min-max band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = METRICS[task]
    fig, axes = plt.subplots(1, len(metrics), figsize=(5.2 * len(metrics), 3.6), squeeze=False)
    any_run = next(iter(groups.values()))[0]
    for axis, metric in zip(axes[0], metrics):
        for group in sorted(groups, key=group_key):
            if "steps" in group:  # budget sweeps are tabulated, not plotted
                continue
            values = aggregate(groups[group], metric)
            lengths = list(values)
            means = [100 * statistics.fmean(v) for v in values.values()]
            axis.plot(lengths, means, marker="o", markersize=3, label=group_label(group))
            axis.fill_between(lengths, [100 * min(v) for v in values.values()],
                              [100 * max(v) for v in values.values()], alpha=0.15)
        axis.axvline(any_run["budget"]["train_length"], color="grey", linestyle="--", linewidth=1)
        axis.set_xscale("log", base=2)
        axis.set_xticks(lengths)
        axis.set_xticklabels([str(length) for length in lengths])
        axis.set_ylim(-2, 102)
        axis.set_xlabel(f"test length ({any_run['length_unit']}); dashed: training length")
        axis.set_ylabel(f"{METRIC_NAMES[metric]} (%)")
        axis.grid(alpha=0.3)
    axes[0][0].set_title(f"{task}: {any_run['family'].upper()}, {any_run['model_config'].get('num_hidden_layers', '?')}"
                         f" layer(s), mean of seeds, band = min-max", fontsize=9)
    axes[0][-1].legend(fontsize=7, loc="best")
    fig.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=90)
    plt.close(fig)
    return output


def write_into_doc(doc: Path, task: str, text: str) -> bool:
    """Replace the text between this task's markers in ``doc``; False when the markers are not there."""
    if not doc.exists():
        return False
    start, end = f"<!-- results:{task}:start -->", f"<!-- results:{task}:end -->"
    content = doc.read_text()
    if start not in content or end not in content:
        return False
    before, rest = content.split(start, 1)
    _, after = rest.split(end, 1)
    doc.write_text(f"{before}{start}\n{text}\n{end}{after}")
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--docs", type=Path, default=DOCS)
    parser.add_argument("--no-plots", action="store_true")
    args = parser.parse_args(argv)

    runs = load(args.results)
    if not runs:
        raise SystemExit(f"no results under {args.results}")
    for task in sorted(runs):
        # families other than the default are their own figure and table (e.g. parity with FoX: tag _fox)
        by_family: dict[str, dict[str, list[dict]]] = defaultdict(dict)
        for group, group_runs in runs[task].items():
            by_family[group_runs[0]["family"]][group] = group_runs
        for family, groups in sorted(by_family.items()):
            name = task if family == "gla" else f"{task}_{family}"
            text = task_tables(task, groups)
            print(f"## {name}\n\n{text}\n")
            if write_into_doc(args.docs / "synthetic.md", name, text):
                print(f"(written into {args.docs / 'synthetic.md'})\n")
            if not args.no_plots:
                print(f"plot: {plot(task, groups, args.docs / f'synthetic_{name}.png')}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
