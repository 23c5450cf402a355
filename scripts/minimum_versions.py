"""Writes a pip constraints file pinning each runtime dependency of pyproject.toml at its `>=` floor (torch excepted:
scripts/test_minimum_versions.sh installs it as scripts/install_torch.sh does). Used by test_minimum_versions.sh.

    python scripts/minimum_versions.py OUT [PYPROJECT]
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import tomllib

FLOOR = re.compile(r"(?P<name>[A-Za-z0-9_.-]+)>=(?P<version>[0-9][0-9A-Za-z.]*)(,<[0-9.]+)?")
NOT_PINNED = {"torch"}  # its build (CPU or CUDA) is the user's choice; see install_torch.sh


def minimum_pins(pyproject: Path) -> list[str]:
    """``name==floor`` for each of ``[project] dependencies``; every one must have a plain ``>=`` floor."""
    pins = []
    for requirement in tomllib.loads(pyproject.read_text())["project"]["dependencies"]:
        match = FLOOR.fullmatch(requirement)
        if match is None:
            raise SystemExit(f"{pyproject}: dependency {requirement!r} has no plain `>=` floor to pin")
        if match["name"] not in NOT_PINNED:
            pins.append(f"{match['name']}=={match['version']}")
    return pins


def main(argv: list[str]) -> None:
    out = Path(argv[0])
    pyproject = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parents[1] / "pyproject.toml"
    pins = minimum_pins(pyproject)
    out.write_text("\n".join(pins) + "\n")
    print("minimum versions:", " ".join(pins))


if __name__ == "__main__":
    main(sys.argv[1:])
