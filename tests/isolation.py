"""Helpers for tests that run code in a fresh interpreter."""

from __future__ import annotations

import textwrap


def import_blocker(*packages: str) -> str:
    """Python source to put first in a subprocess script: afterwards `import <package>` (or any of its submodules)
    raises ImportError in that process, as if the package were not installed."""
    return textwrap.dedent(f"""\
        import importlib.abc, sys
        class _Blocked(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in {packages!r}:
                    raise ImportError("blocked in this process: " + name)
        sys.meta_path.insert(0, _Blocked())
    """)
