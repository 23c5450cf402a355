"""Which of the repository's source files a model's forward runs code from, input_ids to logits (docs/architecture.md).

A tiny model of the family (1 layer, hidden 64) runs once to warm up (imports, the C kernel's build and plans), then
again under ``sys.settrace``: a prefill with a cache, one cached decoding step, a forward without cache, a right-padded
batch of two, and a training forward + backward. Prints each file with the functions called in it, then the count.
The backend is the usual one: set ``SELECTIVE_ROPE_BACKEND`` to pick another (``torch``: no C kernel).

Usage::

    python scripts/forward_files.py                 # GLA
    python scripts/forward_files.py --family fox
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

from selective_rope.families import FAMILIES

ROOT = Path(__file__).resolve().parents[1]
TINY = {"gla": {"num_heads": 2}, "gated_deltanet": {"num_heads": 2, "head_dim": 32},
        "fox": {"num_attention_heads": 2, "num_key_value_heads": 2, "intermediate_size": 128}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", default="gla", choices=sorted(TINY))
    args = parser.parse_args(argv)

    family = FAMILIES[args.family]
    torch.manual_seed(0)
    config = family.config_class(hidden_size=64, num_hidden_layers=1, vocab_size=128, **TINY[args.family])
    model = family.lm_class(config).eval()
    ids = torch.randint(0, 128, (1, 8))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 6:] = 0

    def forward() -> None:
        with torch.no_grad():
            out = model(ids, use_cache=True)
            model(ids[:, :1], past_key_values=out.past_key_values, use_cache=True)
            model(ids)
            model(ids.repeat(2, 1), attention_mask=mask)
        model(ids, labels=ids).loss.backward()

    forward()  # warm-up: imports, the C kernel's build, plans
    seen: dict[str, set[str]] = {}
    root = str(ROOT) + os.sep

    def tracer(frame, event, arg):
        name = frame.f_code.co_filename
        if event == "call" and not name.startswith("<"):
            path = os.path.realpath(name)
            if path.startswith(root) and f"{os.sep}.venv{os.sep}" not in path and path != os.path.realpath(__file__):
                seen.setdefault(os.path.relpath(path, ROOT), set()).add(frame.f_code.co_name)

    sys.settrace(tracer)
    try:
        forward()
    finally:
        sys.settrace(None)
    for path in sorted(seen):
        print(f"{path}: {', '.join(sorted(seen[path]))}")
    print(f"{len(seen)} files ({args.family}, backend {os.environ.get('SELECTIVE_ROPE_BACKEND') or config.backend})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
