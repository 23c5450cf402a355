"""Tables and the plot of the paper's state-tracking setup (docs/synthetic.md, "The paper's setup"), from
the runs keyed parity/paper/<scale>/<variant>_seed<k> in benchmarks/results/synthetic.jsonl (``run_all.sh paper_small
paper_wide``).

    python examples/synthetic/summarize_paper.py [--no-plot]     # prints the tables, writes docs/synthetic_paper.png

The tables are also written into docs/synthetic.md between ``<!-- results:paper:start -->`` and
``<!-- results:paper:end -->``.

Per group: final-token accuracy (%) at every test length (mean over seeds, min-max in brackets), and how many seeds
reach >= 95 % at 2x and 4x the longest training length.
"""

from __future__ import annotations

import argparse
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
BELOW = "parity/paper/"  # the keys of these runs: parity/paper/<scale>/<variant>_seed<k>
PLOT = REPO / "docs" / "synthetic_paper.png"
DOC = REPO / "docs" / "synthetic.md"
MARKERS = ("<!-- results:paper:start -->", "<!-- results:paper:end -->")

SCALES = {"small": "hidden 64, 4 heads, 1500 steps", "wide": "the paper's width: hidden 384, 12 heads, 500 steps"}
LABELS = {"nope": "NoPE", "rope": "RoPE", "paper": "Selective RoPE, paper (θ=1, no gate, bias, conv)",
          "paper_theta500k": "paper, but RoPE temperatures (base 500000)", "paper_gate": "paper, but phase gate on",
          "paper_nobias": "paper, but no phase bias", "paper_noconv": "paper, but no phase convolution"}
TARGET = 0.95


def load(results: Path = RESULTS, below: str = BELOW) -> dict:
    """{scale: {variant: [run, ...]}}, runs sorted by seed, from the runs keyed ``<below><scale>/<variant>_seed<k>``."""
    groups: dict = defaultdict(lambda: defaultdict(list))
    for key, run in sorted(read_runs(results).items()):
        parts = key[len(below):].split("/") if key.startswith(below) else []
        if len(parts) == 2 and "_seed" in parts[1]:
            groups[parts[0]][run["variant"]].append(run)
    for variants in groups.values():
        for runs in variants.values():
            runs.sort(key=lambda run: run["seed"])
    return groups


def final_accuracy(run: dict) -> dict[int, float]:
    return {row["length"]: row["final_token_accuracy"] for row in run["eval"]}


def table(scale: str, variants: dict) -> str:
    any_run = next(iter(variants.values()))[0]
    train_length = any_run["budget"]["train_length"]
    lengths = sorted(final_accuracy(any_run))
    header = [f"{n}{' (train max)' if n == train_length else ''}" for n in lengths]
    lines = [f"{SCALES.get(scale, scale)}; final-token accuracy (%), mean [min–max] over seeds; k/n: seeds ≥ 95 %", "",
             f"| variant | seeds | {' | '.join(header)} | k/n at {2 * train_length} | k/n at {4 * train_length} |",
             "|" + "---|" * (len(lengths) + 4)]
    for variant in [v for v in LABELS if v in variants]:
        runs = variants[variant]
        accuracies = [final_accuracy(run) for run in runs]
        cells = []
        for n in lengths:
            values = [100 * a[n] for a in accuracies]
            cells.append(f"{statistics.fmean(values):.1f} [{min(values):.0f}–{max(values):.0f}]")
        passing = [f"{sum(a.get(m * train_length, 0) >= TARGET for a in accuracies)}/{len(runs)}" for m in (2, 4)]
        lines.append(f"| {LABELS[variant]} | {len(runs)} | {' | '.join(cells)} | {' | '.join(passing)} |")
    return "\n".join(lines)


def plot(groups: dict, path: Path = PLOT) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scales = [s for s in SCALES if s in groups]
    figure, axes = plt.subplots(1, len(scales), figsize=(5.5 * len(scales), 3.8), squeeze=False)
    for axis, scale in zip(axes[0], scales):
        for variant in [v for v in LABELS if v in groups[scale]]:
            accuracies = [final_accuracy(run) for run in groups[scale][variant]]
            lengths = sorted(accuracies[0])
            means = [100 * statistics.fmean(a[n] for a in accuracies) for n in lengths]
            low = [100 * min(a[n] for a in accuracies) for n in lengths]
            high = [100 * max(a[n] for a in accuracies) for n in lengths]
            line = axis.plot(lengths, means, marker="o", label=f"{LABELS[variant]} ({len(accuracies)})")[0]
            axis.fill_between(lengths, low, high, color=line.get_color(), alpha=0.12)
        axis.axvline(32, color="grey", linestyle=":", linewidth=1)
        axis.set_xscale("log", base=2)
        axis.set_xticks([16, 32, 64, 128], ["16", "32", "64", "128"])
        axis.set_ylim(-2, 102)
        axis.set_title(SCALES[scale], fontsize=9)
        axis.set_xlabel("bits (trained on 4–32, dotted)")
    axes[0][0].set_ylabel("final-token accuracy (%), mean; band min–max")
    axes[0][0].legend(fontsize=6.5, loc="lower left")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--plot", type=Path, default=PLOT)
    parser.add_argument("--doc", type=Path, default=DOC, help="page whose results markers receive the tables")
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args(argv)
    groups = load(args.results)
    if not groups:
        raise SystemExit(f"no results under {args.results}")
    scales = [s for s in SCALES if s in groups] + [s for s in groups if s not in SCALES]
    text = "\n\n".join(table(scale, groups[scale]) for scale in scales)
    print(text)
    try:
        write_between_markers(args.doc, *MARKERS, text)
    except (FileNotFoundError, MarkersNotFound) as error:
        print(f"tables not written: {error}", file=sys.stderr)
    else:
        print(f"wrote the tables into {args.doc}")
    if not args.no_plot:
        plot(groups, args.plot)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
