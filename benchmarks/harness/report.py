"""What a benchmark prints and writes: the shared sections' tables, the header and footer of a run, the JSON file."""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path


def log(message: str = "") -> None:
    print(message, flush=True)


def print_prefill_rows(rows: list[dict]) -> None:
    log(f"   {'T':>6} | {'median ms':>10} | {'min ms':>8} | {'tokens/s':>10}")
    for row in rows:
        log(f"   {row['seq_len']:>6} | {row['median_s'] * 1e3:>10.1f} | {row['min_s'] * 1e3:>8.1f} | "
            f"{row['tokens_per_s']:>10.0f}")


def print_decode(dec: dict, number: int) -> None:
    log(f"{number}. Decode (selective_rope, median of {dec['steps']} single-token steps per context, contexts "
        "interleaved)")
    log(f"   {'context':>7} | {'ms/token':>9} | {'min ms':>8} | {'prefill s':>9}")
    for row in dec["rows"]:
        log(f"   {row['context']:>7} | {row['ms_per_token']:>9.2f} | {row['min_s'] * 1e3:>8.2f} | "
            f"{row['prefill_s']:>9.3f}")
    ratio = dec["ratio_target"]["value"] if "ratio_target" in dec else dec["ratio"]
    log(f"   {dec['ratio_name']}: {ratio:.3f}")


def print_overhead(ov: dict, number: int) -> None:
    log(f"{number}. Position-embedding prefill overhead, T={ov['seq_len']} (same seed, {ov['rounds']} interleaved "
        "rounds)")
    log(f"   {'variant':>15} | {'median ms':>10} | {'x NoPE':>7} | {'paired':>7} | {'rotary module, all layers':>25}")
    for name in ov["timings"]:  # nope, rope, selective_rope
        t = ov["timings"][name]["median_s"] * 1e3
        if name == "nope":
            log(f"   {name:>15} | {t:>10.1f} | {1.0:>7.3f} | {1.0:>7.3f} | {'-':>25}")
        else:
            r = ov[f"{name}_over_nope"]
            cost = ov[f"{name}_rotary_cost"]
            log(f"   {name:>15} | {t:>10.1f} | {r['value']:>7.3f} | {r['paired_round_ratio_median']:>7.3f} | "
                f"{cost['ms_all_layers']:>8.1f} ms ({100 * cost['fraction_of_nope_prefill']:>4.1f}% of NoPE)")


def print_header(results: dict, title: str, model_line: str, width: int = 104) -> str:
    info = results["device"]
    line = "=" * width
    log()
    log(line)
    log(f"{title} ({results['mode']})  |  {info['cpu_model'] or info['processor'] or info['machine']}")
    log(f"torch {info['torch_version']}  |  threads {info['torch_num_threads']} / cpu_count {info['cpu_count']}  |  "
        f"{info['date']}  |  load avg start {info['load_average_start']} end {info['load_average_end']}")
    log(model_line)
    log(line)
    return line


def print_footer(results: dict, line: str) -> None:
    log(line)
    log("Targets")
    for key, goal in results["targets"].items():
        status = "MET" if goal["met"] else "MISSED"
        log(f"   {key:50s} {goal['value']:>8.3f}  (target {goal['comparison']} {goal['target']})  {status}")
    busy = ", ".join(f"{key} {c['others_cores'] if c.get('others_cores') is not None else float('nan'):.2f}"
                     for key, c in results["contention"].items() if isinstance(c, dict) and "wall_s" in c)
    log(f"cores kept busy by other processes, per section (including any waits): {busy}")
    quiet = results["contention"]["quiet"]
    log(f"waited for a quiet machine {quiet['waited_s']:.1f} s, redid {quiet['redone_rounds']} disturbed rounds, "
        f"kept {quiet['disturbed_rounds_kept']} disturbed rounds")
    log(f"total wall time {results['total_wall_s']:.1f} s")
    log(line)
    if "warning" in results:
        log(f"WARNING: {results['warning']}")


def write_results(path: Path, results: dict) -> None:
    """Writes ``results`` as JSON to ``path`` whole or not at all: a benchmark killed mid-write (a time limit)
    leaves the previous file, never a truncated one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(results, indent=2, default=str) + "\n"
    partial = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.partial")
    # os.open with O_EXCL: a new file of our own, with the umask's permissions (tempfile's would be 0600)
    descriptor = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(descriptor, "w") as file:  # closing flushes: a full disk may show only there
            file.write(text)
        os.replace(partial, path)
    except BaseException:
        partial.unlink()  # still ours: os.replace is the last step and did not happen
        raise
    log(f"saved {path}")


def comparison_cell(name: str, record: dict, base: str) -> str:
    if name == base:
        return f"{name} {record['median_ms']:.2f}"
    r = record["ratio_to_" + base]
    return f"{name} {record['median_ms']:.2f} ({r['median']:.3f}x [{r['q1']:.3f}-{r['q3']:.3f}])"


def print_comparison(section: dict, title: str, key: str) -> None:
    """A table of ``prefill_comparison`` / ``decode_comparison`` results: medians and paired ratios with quartiles."""
    base = section["base"]
    log(title)
    log(f"   {key:>7} | {'model':>14} | {'median ms':>10} | {'x ' + base + ' (wall), [q1-q3]':>30} | "
        f"{'x ' + base + ' (CPU time)':>20}")
    for row in section["rows"]:
        for name, r in row["models"].items():
            wall = cpu = "-"
            if name != base:
                w, c = r["ratio_to_" + base], r["cpu_ratio_to_" + base]
                wall = f"{w['median']:.3f} [{w['q1']:.3f}-{w['q3']:.3f}]"
                cpu = f"{c['median']:.3f}"
            log(f"   {row[key]:>7} | {name:>14} | {r['median_ms']:>10.2f} | {wall:>30} | {cpu:>20}")


def print_selective_vs_nope(section: dict, number: int) -> None:
    print_comparison(section["decode"], f"{number}. Selective RoPE vs NoPE: cached decoding, ms/token (interleaved)",
                     "context")
    print_comparison(section["prefill"], f"{number}. Selective RoPE vs NoPE: prefill, ms (interleaved)", "seq_len")
