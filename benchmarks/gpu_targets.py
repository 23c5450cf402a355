"""Issue 46's targets, read from the results one ``scripts/gpu_check.sh`` call wrote: Selective RoPE at NoPE's
training speed on a GPU.

- training: Selective RoPE's dense tokens/s >= 0.90x NoPE's, its peak memory within 1 GiB of NoPE's, and its packed
  tokens/s >= 0.95x its dense ones (``models_<family>.json``, ``bench_models_gpu.py``; per family measured);
- the rotary op: the Triton kernels at >= 70 % of the device's peak memory bandwidth at T >= 8k, forward and
  forward + backward (``rotary_gpu.json``, ``bench_rotary_gpu.py``; its minimal-traffic model).

A target whose result file is missing is reported as not measured. Prints one line per target and writes them as
JSON with ``--output``.

Usage::

    python benchmarks/gpu_targets.py $OUT [--output $OUT/targets.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

TRAINING_VS_NOPE = 0.90
PEAK_MEMORY_OVER_NOPE_GIB = 1.0
PACKED_VS_DENSE = 0.95
BANDWIDTH_FRACTION = 0.70
LONG_SEQUENCE = 8192


def _row(rows: list[dict], variant: str, layout: str) -> dict | None:
    """The first (``repeat`` 1) training row of ``variant`` and ``layout``."""
    return next((r for r in rows if r["variant"] == variant and r.get("layout", "dense") == layout
                 and r.get("repeat", 1) == 1), None)


def training_targets(results: dict) -> list[dict]:
    family = results["plan"]["families"][0]
    rows = results.get("training", [])
    nope, dense, packed = (_row(rows, "nope", "dense"), _row(rows, "selective_rope", "dense"),
                           _row(rows, "selective_rope", "packed"))
    targets = []

    def add(name, value, limit, met):
        targets.append({"target": f"{family}: {name}", "value": value, "limit": limit,
                        "met": None if value is None else met(value)})

    ratio = None if not (nope and dense) else round(dense["tokens_per_s"] / nope["tokens_per_s"], 4)
    add("Selective RoPE / NoPE training tokens/s", ratio, f">= {TRAINING_VS_NOPE}", lambda v: v >= TRAINING_VS_NOPE)
    extra = None if not (nope and dense) else round(dense["peak_memory_gib"] - nope["peak_memory_gib"], 2)
    add("Selective RoPE peak memory over NoPE's (GiB)", extra, f"<= {PEAK_MEMORY_OVER_NOPE_GIB}",
        lambda v: v <= PEAK_MEMORY_OVER_NOPE_GIB)
    packing = None if not (dense and packed) else round(packed["tokens_per_s"] / dense["tokens_per_s"], 4)
    add("Selective RoPE packed / dense training tokens/s", packing, f">= {PACKED_VS_DENSE}",
        lambda v: v >= PACKED_VS_DENSE)
    return targets


def bandwidth_targets(results: dict) -> list[dict]:
    targets = []
    for part in ("forward", "forward_backward"):
        for row in results.get(part, []):
            if row["seq_len"] < LONG_SEQUENCE:
                continue
            fraction = row["variants"].get("triton", {}).get("fraction_of_peak")
            targets.append({"target": f"rotary op {part} B={row['batch']} T={row['seq_len']}: fraction of peak "
                                      "bandwidth", "value": fraction, "limit": f">= {BANDWIDTH_FRACTION}",
                            "met": None if fraction is None else fraction >= BANDWIDTH_FRACTION})
    return targets


def collect(directory: Path) -> list[dict]:
    targets = []
    for path in sorted(directory.glob("models_*.json")):
        targets += training_targets(json.loads(path.read_text()))
    rotary = directory / "rotary_gpu.json"
    if rotary.exists():
        targets += bandwidth_targets(json.loads(rotary.read_text()))
    return targets


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", type=Path, help="the folder gpu_check.sh wrote ($OUT)")
    parser.add_argument("--output", type=Path, help="also write the targets there as JSON")
    args = parser.parse_args(argv)
    if not args.directory.is_dir():
        sys.exit(f"gpu_targets.py: {args.directory} is not a folder")
    targets = collect(args.directory)
    if not targets:
        print(f"issue 46 targets: nothing measured in {args.directory} (no models_*.json, no rotary_gpu.json)")
    for t in targets:
        verdict = {True: "met", False: "NOT met", None: "not measured"}[t["met"]]
        print(f"  {t['target']:66s} {t['value']!s:>8} (target {t['limit']}): {verdict}")
    if args.output:
        args.output.write_text(json.dumps(targets, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
