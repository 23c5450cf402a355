"""The ``selective-rope`` command (also ``python -m selective_rope``).

Each subcommand is a module with ``add_parser(commands)`` (its argparse sub-parser) and ``run(args) -> exit status``;
this file only registers them.
"""

from __future__ import annotations

import argparse
import importlib

# subcommand -> its module (relative to this package), in the order `--help` lists them
COMMANDS = {
    "demo": ".demo",
    "convert": ".conversion.cli",
    "generate": ".generate",
    "bench": ".bench",
}


def command_module(name: str):
    return importlib.import_module(COMMANDS[name], __package__)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="selective-rope",
                                     description="Selective RoPE models for Hugging Face Transformers.")
    commands = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        command_module(name).add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return command_module(args.command).run(args)


if __name__ == "__main__":
    raise SystemExit(main())
