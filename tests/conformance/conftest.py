"""The conformance suite (tests/conformance/): transformers' own common model tests on our families, and on Llama as
the control. It downloads the installed transformers' sdist on first use (see ``upstream.py``), so it is collected
only when ``SELECTIVE_ROPE_CONFORMANCE=1``: run it with ``bash scripts/conformance.sh`` (what ``.ci/run`` does); the
default ``pytest tests`` run leaves it out without importing anything of it."""

from __future__ import annotations

import os
import re

ENABLED = os.environ.get("SELECTIVE_ROPE_CONFORMANCE") == "1"
if not ENABLED:
    collect_ignore_glob = ["test_*.py"]


def pytest_configure(config):
    """Register the markers the sdist's tests use (transformers registers them in its own conftest.py)."""
    if not ENABLED:
        return
    import upstream

    package = upstream.fetch()
    for name in upstream.FILES:
        for marker in sorted(set(re.findall(r"@(?:pytest\.)?mark\.(\w+)", (package / name).read_text()))):
            config.addinivalue_line("markers", f"{marker}: used by transformers' {name}")
