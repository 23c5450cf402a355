"""The ``selective-rope`` command (also ``python -m selective_rope``)."""

from __future__ import annotations

import argparse

from .conversion.cli import add_convert_parser, run_convert
from .demo import FAMILIES


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="selective-rope",
                                     description="Selective RoPE models for Hugging Face Transformers.")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="train a tiny model on CPU, save, reload and generate",
                               description="Train a tiny selective-rope model (SelectiveRopeGLA by default) on a "
                               "synthetic task (continuing arithmetic progressions), save it, reload it with "
                               "AutoModelForCausalLM and generate.")
    demo.add_argument("--family", choices=FAMILIES, default="gla", help="model family (default gla)")
    demo.add_argument("--output-dir", default="demo_output", help="where the trained model is saved")
    demo.add_argument("--seconds", type=float, default=60.0, help="training time budget (default 60)")
    demo.add_argument("--max-steps", type=int, default=2000, help="upper bound on training steps")
    demo.add_argument("--seed", type=int, default=0)
    add_convert_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        if args.seconds <= 0 or args.max_steps <= 0:
            raise SystemExit("selective-rope demo: --seconds and --max-steps must be positive")
        from .demo import run_demo

        run_demo(args.output_dir, args.seconds, args.max_steps, args.seed, args.family)
    if args.command == "convert":
        return run_convert(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
