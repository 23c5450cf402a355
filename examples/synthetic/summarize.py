"""Summarise the synthetic-task results: markdown tables (printed, and written into docs/synthetic.md between the
``<!-- results:<task>:start -->`` / ``<!-- results:<task>:end -->`` markers when they are there) and one plot per
task (accuracy vs test length per variant, mean over seeds with the min-max band).

    python examples/synthetic/summarize.py [--results benchmarks/results/synthetic.jsonl] [--docs docs] [--no-plots]

matplotlib is imported only by the plotting step (``pip install matplotlib``); ``--no-plots`` needs none.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:  # examples/: example_utils.py, the helpers the example scripts share
    sys.path.insert(0, str(HERE.parent))

from example_utils import MarkersNotFound, read_runs, write_between_markers  # noqa: E402

REPO = HERE.parent.parent
RESULTS = REPO / "benchmarks" / "results" / "synthetic.jsonl"
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
SEED_KEY = re.compile(r"^(?P<group>.+)_seed(?P<seed>\d+)$")


def load(results: Path = RESULTS, below: str = "") -> dict[str, dict[str, list[dict]]]:
    """``{task: {group: [run, ...]}}`` from the runs keyed ``<below><folder>/<group>_seed<k>`` (the store, or a folder
    of per-run JSON files: ``example_utils.read_runs``)."""
    runs: dict[str, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for key, run in sorted(read_runs(results).items()):
        parts = key[len(below):].split("/") if key.startswith(below) else []
        match = SEED_KEY.match(parts[1]) if len(parts) == 2 else None
        if match and run["task"] in METRICS:  # A3 and the MAD tasks: examples/synthetic/evidence.py summarises them
            runs[run["task"]][match["group"]].append(run)
    return runs


def group_label(group: str) -> str:
    variant = base_variant(group)
    if variant not in LABELS:
        return group
    rest = group[len(variant):].lstrip("_")
    return LABELS[variant] + (f" [{rest}]" if rest else "")


def group_key(group: str) -> tuple:
    base = base_variant(group)
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


THRESHOLD = 0.95


def passing(runs: list[dict], metric: str, length: int) -> str:
    """``k/n``: seeds whose ``metric`` at test length ``length`` is >= THRESHOLD."""
    values = aggregate(runs, metric).get(length, [])
    return f"{sum(v >= THRESHOLD for v in values)}/{len(values)}" if values else "—"


def table(task: str, groups: dict[str, list[dict]], metric: str) -> str:
    """Markdown table: one row per group, one column per test length, mean (min–max) over seeds, in %; and how
    many seeds reach 95 % at twice the training length."""
    lengths = sorted({row["length"] for runs in groups.values() for run in runs for row in run["eval"]})
    any_run = next(iter(next(iter(groups.values()))))
    train_length = any_run["budget"]["train_length"]
    header = [f"{length}{' (train)' if length == train_length else ''}" for length in lengths]
    lines = [f"| variant | seeds | steps × batch | train s | {' | '.join(header)} "
             f"| seeds ≥ 95 % at {2 * train_length} |",
             "| --- | --- | --- | --- | " + " | ".join("---" for _ in lengths) + " | --- |"]
    for group in sorted(groups, key=group_key):
        runs = groups[group]
        values = aggregate(runs, metric)
        budget = runs[0]["budget"]
        seconds = statistics.fmean(r["train_seconds"] for r in runs)
        cells = [fmt(values[length]) if length in values else "—" for length in lengths]
        seeds = ",".join(str(r["seed"]) for r in sorted(runs, key=lambda r: r["seed"]))
        lines.append(f"| {group_label(group)} | {seeds} | {budget['steps']} × {budget['batch']} | {seconds:.0f} | "
                     f"{' | '.join(cells)} | {passing(runs, metric, 2 * train_length)} |")
    return "\n".join(lines)


def budget_sweep(task: str, groups: dict[str, list[dict]]) -> str | None:
    """For settings with ``<group>_steps<k>`` groups: the headline metric at the training length and at twice it,
    per variant, seed and budget (``<group>`` itself contributes its runs with the same seeds at its own budget)."""
    sweeps = [g for g in groups if re.search(r"_steps\d+$", g)]
    if not sweeps:
        return None
    metric = METRICS[task][0]
    seeds = sorted({run["seed"] for g in sweeps for run in groups[g]})
    mains = {re.sub(r"_steps\d+$", "", g) for g in sweeps}
    cells: dict[tuple[str, int], dict[int, str]] = defaultdict(dict)
    for group in [g for g in groups if g in mains or g in sweeps]:
        for run in groups[group]:
            if run["seed"] not in seeds:
                continue
            train_length = run["budget"]["train_length"]
            by_length = {row["length"]: row[metric] for row in run["eval"]}
            text = " / ".join(f"{100 * by_length[n]:.1f}" if n in by_length else "—"
                              for n in (train_length, 2 * train_length))
            cells[(re.sub(r"_steps\d+$", "", group), run["seed"])][run["budget"]["steps"]] = text
    budgets = sorted({steps for row in cells.values() for steps in row})
    any_run = groups[sweeps[0]][0]
    lines = [f"Budget sweep: {METRIC_NAMES[metric]} (%) at the training length / at twice it "
             f"({any_run['budget']['train_length']} / {2 * any_run['budget']['train_length']} "
             f"{any_run['length_unit']}), by number of steps (batch {any_run['budget']['batch']}):", "",
             "| variant | seed | " + " | ".join(f"{b} steps" for b in budgets) + " |",
             "| --- | --- | " + " | ".join("---" for _ in budgets) + " |"]
    for group, seed in sorted(cells, key=lambda key: (group_key(key[0]), key[1])):
        row = cells[(group, seed)]
        lines.append(f"| {group_label(group)} | {seed} | " + " | ".join(row.get(b, "—") for b in budgets) + " |")
    return "\n".join(lines)


def task_tables(task: str, groups: dict[str, list[dict]]) -> str:
    unit = next(iter(groups.values()))[0]["length_unit"]
    parts = []
    for metric in METRICS[task]:
        parts.append(f"{METRIC_NAMES[metric]} (%) by test length ({unit}); mean over seeds (min–max):\n\n"
                     + table(task, groups, metric))
    sweep = budget_sweep(task, groups)
    if sweep:
        parts.append(sweep)
    return "\n\n".join(parts)


def base_variant(group: str) -> str:
    return next((v for v in sorted(ORDER, key=len, reverse=True) if group == v or group.startswith(v + "_")), group)


def plotted(groups: dict[str, list[dict]]) -> list[str]:
    """Groups drawn in a figure: all but budget-sweep rows (``_steps<k>``) that have fewer seeds than another group
    of the same variant (those are tabulated only)."""
    most = defaultdict(int)
    for group, runs in groups.items():
        most[base_variant(group)] = max(most[base_variant(group)], len(runs))
    return [g for g in sorted(groups, key=group_key)
            if not ("steps" in g and len(groups[g]) < most[base_variant(g)])]


def plot(task: str, groups: dict[str, list[dict]], output: Path) -> Path:
    """Accuracy vs test length: one line per group (mean over seeds) and one dot per seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = METRICS[task]
    fig, axes = plt.subplots(1, len(metrics), figsize=(5.4 * len(metrics), 3.7), squeeze=False)
    any_run = next(iter(groups.values()))[0]
    lengths = sorted({row["length"] for runs in groups.values() for run in runs for row in run["eval"]})
    shown = plotted(groups)
    for axis, metric in zip(axes[0], metrics):
        for number, group in enumerate(shown):
            values = aggregate(groups[group], metric)
            xs = list(values)
            line, = axis.plot(xs, [100 * statistics.fmean(v) for v in values.values()], marker="o", markersize=3,
                              linewidth=1.5, label=f"{group_label(group)} (n={len(groups[group])})")
            offset = 1 + 0.025 * (number - (len(shown) - 1) / 2)  # spread the seeds' dots sideways (log axis)
            for x, v in values.items():
                axis.scatter([x * offset] * len(v), [100 * y for y in v], s=7, color=line.get_color(), alpha=0.45,
                             linewidths=0)
        axis.axvline(any_run["budget"]["train_length"], color="grey", linestyle="--", linewidth=1)
        axis.set_xscale("log", base=2)
        axis.set_xticks(lengths)
        axis.set_xticklabels([str(length) for length in lengths])
        axis.minorticks_off()
        axis.set_ylim(-3, 103)
        axis.set_xlabel(f"test length ({any_run['length_unit']}); dashed: training length")
        axis.set_ylabel(f"{METRIC_NAMES[metric]} (%)")
        axis.grid(alpha=0.3)
    config = any_run["model_config"]
    axes[0][0].set_title(f"{task}: {any_run['family'].upper()}, {config.get('num_hidden_layers', '?')} layer(s), "
                         f"hidden {config.get('hidden_size', '?')}; line = mean over seeds, dots = seeds", fontsize=8)
    axes[0][-1].legend(fontsize=6.5, loc="best")
    fig.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=90)
    plt.close(fig)
    return output


def settings(task: str, groups: dict[str, list[dict]]) -> dict[str, dict[str, list[dict]]]:
    """Split a task's groups into settings (family, model width, training length): each is one table and one figure.
    The setting with the most runs is named after the task; the others get a suffix."""
    split: dict[tuple, dict[str, list[dict]]] = defaultdict(dict)
    for group, runs in groups.items():
        run = runs[0]
        split[(run["family"], run["model_config"].get("hidden_size"), run["budget"]["train_length"])][group] = runs
    main_key = max(split, key=lambda key: (key[0] == "gla", sum(len(r) for r in split[key].values())))
    named = {}
    for key, value in split.items():
        family, hidden, train_length = key
        name = task if key == main_key else "_".join(
            [task] + ([family] if family != main_key[0] else [])
            + ([f"hidden{hidden}_len{train_length}"] if (hidden, train_length) != main_key[1:] else []))
        named[name] = value
    return dict(sorted(named.items()))


# The parity recipe sweep: runs stored under parity/sweep/ (outside the main tables), one group per training recipe,
# compared with the main gate and gate + bias rows.
SWEEP_BASELINES = ("selective", "selective_gate_bias")
RECIPE_FIELDS = (("layers", "layers {}"), ("hidden", "hidden {}"), ("heads", "heads {}"),
                 ("train_length", "training length {}"), ("steps", "steps {}"), ("batch", "batch {}"),
                 ("lr", "lr {:g}"), ("weight_decay", "weight decay {:g}"),
                 ("lr_floor", "lr floor {:g}"), ("label_smoothing", "label smoothing {:g}"),
                 ("curriculum_steps", "length ramp over {} steps"), ("bit_density", "bit density {}"))


def recipe(run: dict) -> str:
    """What a run changed from its task's defaults (training settings and config fields)."""
    import train  # the defaults live next to the training code

    defaults = train.task_settings(run["task"])
    settings = run["task_settings"]
    changes = [text.format(settings[key]) for key, text in RECIPE_FIELDS
               if key in settings and settings[key] != defaults.get(key)]
    config_defaults = defaults.get("config", {})
    changes += [f"{key}={value:g}" if isinstance(value, float) else f"{key}={value}"
                for key, value in run["config_overrides"].items() if config_defaults.get(key) != value]
    return ", ".join(changes) or "defaults"


def recipe_sweep(results: Path, main_groups: dict[str, list[dict]]) -> str | None:
    """Parity final-token accuracy per recipe: how many seeds learn the training length L, how many reach 95 % at 2L
    and 4L, and the mean (min–max) at 2L. L is each recipe's own training length."""
    sweep = load(results, below="parity/").get("parity")  # parity/sweep/<group>_seed<k> (the main runs: parity/...)
    if not sweep:
        return None
    groups = {group: main_groups[group] for group in SWEEP_BASELINES if group in main_groups}
    groups.update(sweep)
    metric = "final_token_accuracy"
    lines = ["parity recipe sweep, final-token accuracy at the training length L, 2L and 4L: seeds at ≥ 95 % at L "
             "(learned), at 2L and at 4L; mean (min–max) at 2L, %:", "",
             "| variant | recipe | L (bits) | seeds | learned | ≥ 95 % at 2L | ≥ 95 % at 4L | final-token acc. at 2L |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for group in sorted(groups, key=lambda g: (g in sweep, base_variant(g), g)):
        runs = groups[group]
        length = runs[0]["budget"]["train_length"]
        values = aggregate(runs, metric)
        lines.append(f"| {LABELS[base_variant(group)]} | {recipe(runs[0]) if group in sweep else 'main runs'} | "
                     f"{length} | {len(runs)} | {passing(runs, metric, length)} | "
                     f"{passing(runs, metric, 2 * length)} | {passing(runs, metric, 4 * length)} | "
                     f"{fmt(values.get(2 * length, [0.0]))} |")
    return "\n".join(lines)


def write_into_doc(doc: Path, task: str, text: str) -> bool:
    """Replace the text between this task's markers in ``doc``; False when the page or the markers are not there
    (not every setting has a table on the page)."""
    try:
        write_between_markers(doc, f"<!-- results:{task}:start -->", f"<!-- results:{task}:end -->", text)
    except (FileNotFoundError, MarkersNotFound):
        return False
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
        for name, groups in settings(task, runs[task]).items():
            text = task_tables(task, groups)
            print(f"## {name}\n\n{text}\n")
            if write_into_doc(args.docs / "synthetic.md", name, text):
                print(f"(written into {args.docs / 'synthetic.md'})\n")
            if not args.no_plots:
                print(f"plot: {plot(task, groups, args.docs / f'synthetic_{name}.png')}\n")
    sweep = recipe_sweep(args.results, runs.get("parity", {}))
    if sweep:
        print(f"## parity_sweep\n\n{sweep}\n")
        write_into_doc(args.docs / "synthetic.md", "parity_sweep", sweep)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
