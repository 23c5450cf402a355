"""Write docs/performance.md, the current performance page, from the result files under benchmarks/results/.

    python benchmarks/performance_page.py            # rewrite docs/performance.md
    python benchmarks/performance_page.py --check    # exit 1 if the committed page is not what the results give

Every table names the file it comes from, the command that wrote it (where the file records one), the machine, the
date and the commit. The page is generated: edit this script or rerun a benchmark, never the page.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PAGE = ROOT / "docs" / "performance.md"

COMPARISONS = [  # (file, results key, title)
    ("fox_vs_llama_cpu.json", "peer", "FoX against transformers' Llama (a random Llama converted three ways)"),
    ("gla_selective_vs_nope_cpu.json", "compare", "GLA: Selective RoPE against NoPE"),
    ("gated_deltanet_selective_vs_nope_cpu.json", "compare", "Gated DeltaNet: Selective RoPE against NoPE"),
]
FAMILY_RUNS = [("gla_cpu.json", "GLA"), ("gated_deltanet_cpu.json", "Gated DeltaNet"), ("fox_cpu.json", "FoX")]


def load(name: str) -> dict | None:
    path = RESULTS / name
    return json.loads(path.read_text()) if path.exists() else None


def provenance(name: str, record: dict) -> str:
    device, source = record.get("device", {}), record.get("source", {})
    machine = device.get("cpu_model") or device.get("processor") or "?"
    threads = device.get("torch_num_threads", "?")
    versions = ", ".join(f"{label} {device[key]}" for label, key in
                         (("torch", "torch_version"), ("transformers", "transformers_version")) if device.get(key))
    command = f"`{record['command']}`" if record.get("command") else "its script (the file records no command)"
    commit = (source.get("git_commit") or "")[:8] or "?"
    load = None if "rows" in record and "load_average_before" in record["rows"][0] or "load_average_before" in record \
        else device.get("load_average_start")  # records with loads of their own give them where they are measured
    load_text = f", load average at the start {' / '.join(map(str, load))}" if load else ""
    return (f"Source: [`benchmarks/results/{name}`](../benchmarks/results/{name}), written by {command}; "
            f"{machine}, {threads} threads, {versions}; {device.get('date', 'date not recorded')}, commit "
            f"{commit}{load_text}.")


def ratio_cell(model: dict, base: str) -> str:
    ratio, cpu = model.get(f"ratio_to_{base}"), model.get(f"cpu_ratio_to_{base}")
    if ratio is None:
        return f"{model['median_ms']:g}"
    text = f"{model['median_ms']:g} (**{ratio['median']:.2f}×** [{ratio['q1']:.2f}–{ratio['q3']:.2f}]"
    return text + (f"; CPU {cpu['median']:.2f}×)" if cpu else ")")


def comparison_table(section: dict) -> list[str]:
    """One row per decode context and prefill length; a column per model: median ms (ratio to the base, quartiles of
    the per-round ratios; CPU time ratio)."""
    base = section["decode"]["base"]
    models = list(section["decode"]["rows"][0]["models"])
    lines = [f"| measurement | {' | '.join(models)} |", f"| --- |{' --- |' * len(models)}"]
    for row in section["decode"]["rows"]:
        cells = [ratio_cell(row["models"][name], base) for name in models]
        lines.append(f"| decode ms/token after {row['context']} tokens | {' | '.join(cells)} |")
    for row in section["prefill"]["rows"]:
        cells = [ratio_cell(row["models"][name], base) for name in models]
        lines.append(f"| prefill ms at T = {row['seq_len']} | {' | '.join(cells)} |")
    return lines


def targets_table(targets: dict) -> list[str]:
    lines = ["| target | value | goal | met |", "| --- | --- | --- | --- |"]
    for name, target in targets.items():
        lines.append(f"| {name} | {target['value']:g} | {target['comparison']} {target['target']:g} | "
                     f"{'yes' if target['met'] else '**no**'} |")
    return lines


def width_table(record: dict) -> list[str]:
    lines = ["| decoding after 256 tokens | parameters (Selective RoPE) | nope ms/token | selective_rope ms/token | "
             "ratio [quartiles] |", "| --- | --- | --- | --- | --- |"]
    for row in record["rows"]:
        (decode,) = [r for r in row["decode"]["rows"] if r["context"] == 256] or row["decode"]["rows"][:1]
        nope, selective = decode["models"]["nope"], decode["models"]["selective_rope"]
        ratio = selective["ratio_to_nope"]
        lines.append(f"| {row['family']}, hidden {row['hidden_size']} | {row['num_parameters']['selective_rope']:,} | "
                     f"{nope['median_ms']:g} | {selective['median_ms']:g} | {ratio['median']:.3f}× "
                     f"[{ratio['q1']:.2f}–{ratio['q3']:.2f}] |")
    return lines


def demo_threads_table(record: dict) -> list[str]:
    lines = ["| busy processes beside it | torch threads | OMP_WAIT_POLICY | ms per demo training step | load average "
             "before |", "| --- | --- | --- | --- | --- |"]
    for row in record["rows"]:
        load = " / ".join(map(str, row["load_average_before"] or [])) or "n/a"
        lines.append(f"| {row['busy_processes']} | {row['threads']} | {row['omp_wait_policy']} | "
                     f"{row['median_step_ms']:g} | {load} |")
    return lines


def compile_lines(record: dict) -> list[str]:
    load = " / ".join(map(str, record["load_average_before"] or [])) or "n/a"
    after = " / ".join(map(str, record["load_average_after"] or [])) or "n/a"
    breaks = record["graph_breaks"]
    return [f"- {record['family']}: eager training step {record['eager_step_s'] * 1e3:.0f} ms; the first compiled "
            f"step (a cold compile: tracing, inductor, C++ builds) **{record['first_compiled_step_s']:g} s**; the "
            f"second {record['second_compiled_step_s'] * 1e3:.0f} ms; load average {load} before, {after} after.",
            f"- Graph breaks dynamo reported: {len(breaks)} distinct reasons, {sum(breaks.values())} in all"
            + (": " + "; ".join(f"{reason.splitlines()[0]} ({count}×)" for reason, count in breaks.items())
               if breaks else ".")]


def page() -> str:
    out = ["# Performance", "",
           "<!-- Generated by `python benchmarks/performance_page.py` from benchmarks/results/; do not edit. -->", "",
           "The current figures, each from one result file (the command that wrote it is given with it). Ratios are "
           "medians of per-round ratios of interleaved runs (quartiles in brackets); \"CPU\" is the same for the "
           "process CPU time. How the harness measures (interleaving, waiting for a quiet machine, redoing disturbed "
           "rounds): [cpu_performance.md](cpu_performance.md), which also keeps the history of how the figures got "
           "here. GPU runs: [gpu_performance.md](gpu_performance.md) and the raw records in "
           "[benchmarks/results/gpu/](../benchmarks/results/gpu/).", ""]
    out += ["## CPU: Selective RoPE's cost at inference", ""]
    for name, key, title in COMPARISONS:
        record = load(name)
        if record is None:
            continue
        out += [f"### {title}", "", *comparison_table(record[key]), "",
                *(targets_table(record[key]["targets"]) if record[key].get("targets") else []), "",
                provenance(name, record), ""]
    record = load("decode_width_cpu.json")
    if record is not None:
        out += ["### At the paper's width", "", "The rotary module's cost per layer and token is nearly fixed while a "
                "layer's grows with the hidden size squared: decoding at hidden 256 and at fla's 340M width "
                "(hidden 1024).", "", *width_table(record), "", provenance("decode_width_cpu.json", record), ""]
    out += ["## CPU: each family's benchmark targets", ""]
    for name, title in FAMILY_RUNS:
        record = load(name)
        if record is not None:
            out += [f"### {title}", "", *targets_table(record["targets"]), "", provenance(name, record), ""]
    record = load("demo_threads_cpu.json")
    if record is not None:
        out += ["## Threads on a loaded machine (the demo)", "",
                "One training step of the demo's model (2-layer GLA, hidden 64, 32 × 25 tokens) by torch thread "
                "count and OpenMP wait policy, next to busy processes the script starts; why the demo trains on one "
                "thread: [demo.md](demo.md).", "", *demo_threads_table(record), "",
                provenance("demo_threads_cpu.json", record), ""]
    compiles = sorted(RESULTS.glob("compile_time_cpu*.json"))
    if compiles:
        out += ["## torch.compile of a toy model", "", "The demo's model (2 layers, hidden 64), one training step "
                "(forward + backward, 32 × 25 tokens) compiled cold (`python benchmarks/compile_time_cpu.py`); other "
                "processes change the figure a lot, so the load average is given with it.", ""]
        for path in compiles:
            record = load(path.name)
            out += [*compile_lines(record), "", provenance(path.name, record), ""]
    return "\n".join(out).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only compare the committed page with the results'")
    args = parser.parse_args(argv)
    text = page()
    if args.check:
        if not PAGE.exists() or PAGE.read_text() != text:
            print(f"{PAGE.relative_to(ROOT)} is not what the results give: run python benchmarks/performance_page.py",
                  file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text)
    print(f"wrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
