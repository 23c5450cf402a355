"""Tables and the plot behind docs/lm.md, from the runs in benchmarks/results/lm.jsonl (keyed
<family>/<variant>_seed<k>).

    python examples/lm/summarize_lm.py            # prints the markdown table, writes lm_summary.json and docs/lm.png

The table is also written into docs/lm.md between the ``<!-- results:lm:start -->`` / ``<!-- results:lm:end -->``
markers.

Every number is the mean over seeds with the sample standard deviation; the seeds of each group are listed in
benchmarks/results/lm_summary.json. Matplotlib is imported only to draw the plot.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:  # examples/: example_utils.py, the helpers the example scripts share
    sys.path.insert(0, str(HERE.parent))

from example_utils import MarkersNotFound, read_runs, write_between_markers  # noqa: E402

REPO = HERE.parent.parent
RESULTS = REPO / "benchmarks" / "results" / "lm.jsonl"
SUMMARY = REPO / "benchmarks" / "results" / "lm_summary.json"
PLOT = REPO / "docs" / "lm.png"
DOC = REPO / "docs" / "lm.md"
MARKERS = ("<!-- results:lm:start -->", "<!-- results:lm:end -->")

FAMILY_NAMES = {"gla": "GLA", "gated_deltanet": "Gated DeltaNet", "fox": "FoX"}
VARIANT_NAMES = {"nope": "NoPE", "rope": "RoPE", "selective": "Selective RoPE (gate)",
                 "selective_bias": "Selective RoPE (bias)", "selective_gate_bias": "Selective RoPE (gate + bias)"}


def load(results: Path = RESULTS) -> dict:
    """{family: {variant: [result, ...]}} sorted by seed."""
    groups: dict = defaultdict(lambda: defaultdict(list))
    for key, result in sorted(read_runs(results).items()):
        if key.count("/") != 1 or "_seed" not in key:
            continue
        groups[result["family"]][result["variant"]].append(result)
    for variants in groups.values():
        for runs in variants.values():
            runs.sort(key=lambda r: r["seed"])
    return groups


def mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else math.nan)


def summarize(groups: dict) -> list[dict]:
    """One row per (family, variant): perplexity at each evaluated length, and past the training length."""
    rows = []
    for family in [f for f in FAMILY_NAMES if f in groups]:
        for variant in [v for v in VARIANT_NAMES if v in groups[family]]:
            runs = groups[family][variant]
            row = {"family": family, "variant": variant, "seeds": [r["seed"] for r in runs],
                   "train_length": runs[0]["settings"]["length"], "perplexity": {}, "beyond_train_length": {},
                   "train_seconds": mean_std([r["train_seconds"] for r in runs])[0]}
            for index, evaluation in enumerate(runs[0]["eval"]):
                length = evaluation["length"]
                row["perplexity"][length] = mean_std([r["eval"][index]["perplexity"] for r in runs])
                if "beyond_train_length" in evaluation:
                    row["beyond_train_length"][length] = mean_std(
                        [r["eval"][index]["beyond_train_length"]["perplexity"] for r in runs])
            row["paired_vs_nope"] = paired_difference(runs, groups[family].get("nope", []))
            rows.append(row)
    return rows


def paired_difference(runs: list[dict], baseline: list[dict]) -> dict:
    """{length: (mean, std)} of the perplexity minus NoPE's on the same seed (the same training windows and the same
    held-out tokens), over the seeds both have; empty when they share none."""
    by_seed = {run["seed"]: run for run in baseline}
    shared = [run for run in runs if run["seed"] in by_seed]
    if not shared:
        return {}
    return {evaluation["length"]: mean_std([run["eval"][index]["perplexity"]
                                            - by_seed[run["seed"]]["eval"][index]["perplexity"] for run in shared])
            for index, evaluation in enumerate(shared[0]["eval"])}


def fmt(pair: tuple[float, float], signed: bool = False) -> str:
    mean, std = pair
    text = f"{mean:+.1f}" if signed else f"{mean:.1f}"
    return text if math.isnan(std) else f"{text} ± {std:.1f}"


def table(rows: list[dict]) -> str:
    lengths = sorted({length for row in rows for length in row["perplexity"]})
    beyond = sorted({length for row in rows for length in row["beyond_train_length"]})
    header = (["model", "position", "seeds"] + [f"ppl @ {n}" for n in lengths]
              + [f"ppl of positions ≥ {rows[0]['train_length']} @ {n}" for n in beyond]
              + [f"paired Δ vs NoPE @ {n}" for n in (lengths[0], lengths[-1])])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cells = [FAMILY_NAMES[row["family"]], VARIANT_NAMES[row["variant"]], str(len(row["seeds"]))]
        cells += [fmt(row["perplexity"][n]) for n in lengths] + [fmt(row["beyond_train_length"][n]) for n in beyond]
        cells += [("—" if row["variant"] == "nope" or n not in row["paired_vs_nope"]
                   else fmt(row["paired_vs_nope"][n], signed=True)) for n in (lengths[0], lengths[-1])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path = PLOT) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    families = [f for f in FAMILY_NAMES if any(row["family"] == f for row in rows)]
    figure, axes = plt.subplots(1, len(families), figsize=(4.2 * len(families), 3.6), squeeze=False)
    for axis, family in zip(axes[0], families):
        for row in [r for r in rows if r["family"] == family]:
            lengths = sorted(row["perplexity"])
            means = [row["perplexity"][n][0] for n in lengths]
            stds = [0.0 if math.isnan(row["perplexity"][n][1]) else row["perplexity"][n][1] for n in lengths]
            axis.errorbar(lengths, means, yerr=stds, marker="o", capsize=3,
                          label=f"{VARIANT_NAMES[row['variant']]} ({len(row['seeds'])})")
        axis.axvline(rows[0]["train_length"], color="grey", linestyle=":", linewidth=1)
        axis.set_xscale("log", base=2)
        axis.set_xticks(lengths, [str(n) for n in lengths])
        axis.set_title(FAMILY_NAMES[family])
        axis.set_xlabel("evaluation window (tokens); dotted: training length")
    axes[0][0].set_ylabel("held-out perplexity (mean ± std over seeds)")
    axes[0][-1].legend(fontsize=7)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=RESULTS, help="the runs: a JSON Lines store or a folder")
    parser.add_argument("--summary", type=Path, default=SUMMARY, help="where the summary JSON goes")
    parser.add_argument("--plot", type=Path, default=PLOT)
    parser.add_argument("--doc", type=Path, default=DOC, help="page whose results markers receive the table")
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args(argv)
    rows = summarize(load(args.results))
    if not rows:
        raise SystemExit(f"no results under {args.results}")
    text = table(rows)
    print(text)
    try:
        write_between_markers(args.doc, *MARKERS, text)
    except (FileNotFoundError, MarkersNotFound) as error:
        print(f"table not written: {error}", file=sys.stderr)
    else:
        print(f"wrote the table into {args.doc}")
    args.summary.write_text(json.dumps(rows, indent=1) + "\n")
    if not args.no_plot:
        plot(rows, args.plot)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
