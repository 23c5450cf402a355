"""Helpers shared by the example scripts under examples/ (not part of the library): the learning-rate schedule of
the training scripts, and writing a table between two markers of a docs page for the summaries.

Each script puts this folder on ``sys.path`` before importing from here, so it runs the same way whether started as
``python examples/<area>/<script>.py`` from anywhere or imported by the tests in tests/cli/.
"""

from __future__ import annotations

import json
import math
import os
import stat
import tempfile
from pathlib import Path


def lr_at(step: int, steps: int, lr: float, warmup: float = 0.05, floor: float = 0.1) -> float:
    """Linear warm-up over ``warmup`` of the steps, then cosine decay from ``lr`` to ``floor * lr``."""
    warm = max(1, int(warmup * steps))
    if step < warm:
        return lr * (step + 1) / warm
    progress = (step - warm) / max(1, steps - warm)
    return lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


class MarkersNotFound(ValueError):
    """A page has no single region to write into: a marker is missing, appears twice, or the end precedes the start."""


def write_between_markers(doc: Path, start: str, end: str, text: str) -> None:
    """Replace what lies between the ``start`` and ``end`` marker strings of ``doc`` with ``text``, on lines of its
    own; the markers and everything outside them stay as they are.

    Raises ``FileNotFoundError`` when ``doc`` does not exist and ``MarkersNotFound`` when the markers do not delimit
    exactly one region; ``doc`` is then left untouched (every check comes before the one write). The write replaces
    the file by a rename, so an interruption leaves the old page whole.
    """
    content = Path(doc).read_text(encoding="utf-8")
    counts = {marker: content.count(marker) for marker in (start, end)}
    if any(count != 1 for count in counts.values()):
        found = ", ".join(f"{marker!r} {count} times" for marker, count in counts.items())
        raise MarkersNotFound(f"{doc}: expected each marker exactly once, found {found}")
    head, rest = content.split(start, 1)
    if end not in rest:
        raise MarkersNotFound(f"{doc}: the end marker {end!r} comes before the start marker {start!r}")
    tail = rest.split(end, 1)[1]
    _replace_atomically(Path(doc).resolve(), f"{head}{start}\n{text}\n{end}{tail}")  # through a link, as a write


def _replace_atomically(path: Path, content: str) -> None:
    """Write ``content`` to a new file beside ``path`` and rename it over ``path``: the page is the old one or the new
    one whatever happens (an interrupted write leaves no half page), with the old page's permissions."""
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as file:
            file.write(content)
        os.chmod(temporary, stat.S_IMODE(path.stat().st_mode))
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise


# -- results: one JSON Lines file per experiment ---------------------------------------------------------------------

def store_run(store: Path, key: str, result: dict) -> None:
    """Put ``result`` into the JSON Lines file ``store`` as the line ``{"run": key, **result}``, replacing the line
    with the same key if there is one (a rerun), else appending; the file is replaced whole or not at all."""
    store = Path(store)
    runs = read_runs(store) if store.exists() else {}
    runs[key] = result
    store.parent.mkdir(parents=True, exist_ok=True)
    if not store.exists():
        store.touch()
    _replace_atomically(store.resolve(), "".join(json.dumps({"run": name, **run}) + "\n" for name, run in runs.items()))


def read_runs(location: Path) -> dict[str, dict]:
    """``{key: run}`` from a JSON Lines store written by :func:`store_run`, or from a folder of per-run JSON files
    (``--output`` of the training scripts; the key is the path below the folder without ``.json``)."""
    location = Path(location)
    if location.is_dir():
        return {path.relative_to(location).with_suffix("").as_posix(): json.loads(path.read_text())
                for path in sorted(location.rglob("*.json"))}
    if not location.exists():
        return {}
    runs = {}
    for number, line in enumerate(location.read_text().splitlines(), 1):
        if line.strip():
            run = json.loads(line)
            if not isinstance(run, dict) or not isinstance(run.get("run"), str):
                raise ValueError(f"{location}:{number}: not a stored run (a JSON object with a \"run\" key)")
            runs[run.pop("run")] = run
    return runs


def runs_below(runs: dict[str, dict], prefix: str = "") -> dict[str, dict]:
    """The runs whose key is ``prefix`` followed by one more path component: ``{that component: run}``."""
    return {key[len(prefix):]: run for key, run in runs.items()
            if key.startswith(prefix) and "/" not in key[len(prefix):]}
