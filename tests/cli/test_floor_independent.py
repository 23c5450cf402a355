"""The marker ``floor_independent`` that scripts/test_minimum_versions.sh deselects: its claim checked for every module
that uses it.

The floors run changes only the pinned runtime dependencies (scripts/minimum_versions.py: transformers, accelerate,
peft, huggingface-hub, safetensors, tqdm); torch, triton and flash-linear-attention are the same as in the main run.
A test module that never imports a pinned package therefore runs the same code at the same versions twice, and the
floors run skips it. The claim is checked here, for each marked module in a fresh interpreter of its own where the
pinned packages are blocked (importing one raises ImportError, and is reported even where the importer catches it):
the module is imported, and every import statement of it, wherever it stands (in functions too), of every module of
this repository it reaches and of the scripts it runs (``RUNS``) is executed.

Two imports are let through, both made by every unmarked module of the floors run, where they stay tested:
``selective_rope``'s own ``__init__`` (it registers the families with transformers' Auto classes; its sub-packages
are reached without it) is not run, and ``import torch`` loads tqdm (for torch.hub's download bars) before the block.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
MARKER = "floor_independent"

# The scripts a marked module runs in a subprocess (their imports are checked as the module's): a marked module that
# imports subprocess must be listed here.
RUNS = {"tests/kernels/test_triton_gpu_compile.py": ["benchmarks/triton_resources.py"],
        "tests/cli/test_floor_independent.py": []}  # this module: its subprocesses run CHECK, checked by the canary
# conftest.py's fixtures that build models of the families (transformers' classes): a marked module must not use them.
MODEL_FIXTURES = {"family"}

# The check's outcome does not depend on the pinned versions (it blocks those packages): the main run makes it.
pytestmark = pytest.mark.floor_independent


def pinned_packages() -> set[str]:
    """The import names of the distributions scripts/minimum_versions.py pins (e.g. huggingface_hub)."""
    spec = importlib.util.spec_from_file_location("minimum_versions", REPO / "scripts" / "minimum_versions.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    pinned = {pin.split("==")[0].lower().replace("_", "-") for pin in module.minimum_pins(REPO / "pyproject.toml")}
    names, found = set(), set()
    for name, dists in importlib.metadata.packages_distributions().items():
        for dist in {dist.lower().replace("_", "-") for dist in dists} & pinned:
            names.add(name)
            found.add(dist)
    assert found == pinned, f"pinned distributions not installed: {sorted(pinned - found)}"
    return names


def marked_modules() -> list[Path]:
    """Test modules that name the marker anywhere (a marked function counts as claiming its module)."""
    return sorted(path for path in TESTS.rglob("test_*.py")
                  if any(isinstance(node, ast.Attribute) and node.attr == MARKER
                         for node in ast.walk(ast.parse(path.read_text()))))


# Runs in a fresh interpreter: argv[1] is {"pinned": [...], "repo": ..., "files": [files to check]}; prints the
# problems found (a JSON list). The first file (a test module) is also imported whole.
CHECK = r"""
import ast, importlib, importlib.abc, importlib.util, json, sys, types
from pathlib import Path

task = json.loads(sys.argv[1])
pinned = set(task["pinned"])
repo = Path(task["repo"])
DYNAMIC = {"import_module", "importorskip", "__import__"}


reached = []  # every attempt to import a pinned package, also those whose ImportError someone caught


class Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in pinned:
            reached.append(name)
            raise ImportError(f"pinned package imported: {name}")


# torch's own import loads tqdm (torch.hub's download bars, which no test uses): that one is let through, and dropped
# from sys.modules so that any later import of it is seen.
import torch
for loaded in [name for name in sys.modules if name.split(".")[0] in pinned]:
    del sys.modules[loaded]
sys.meta_path.insert(0, Blocked())
# selective_rope without its __init__ (the one exemption, see the test's docstring)
spec = importlib.util.find_spec("selective_rope")
package = types.ModuleType("selective_rope")
package.__path__, package.__spec__ = list(spec.submodule_search_locations), spec
sys.modules["selective_rope"] = package
sys.path[:0] = [str(repo / "tests"), str(repo / "benchmarks")]


def ours(name):
    file = getattr(sys.modules.get(name), "__file__", None)
    path = file and Path(file).resolve()
    return path if path and path.is_relative_to(repo) and ".venv" not in path.parts else None


def shown(path):
    return path.relative_to(repo) if path.is_relative_to(repo) else path


def where(path):
    # the module name and package a file was imported under (a test module or script: neither)
    for name in list(sys.modules):
        if ours(name) == path:
            return name, sys.modules[name].__package__ or ""
    return "__main__", ""


def imported_names(node, package_name):
    # the modules an import statement or a dynamic import call (string argument) reaches
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        base = importlib.util.resolve_name("." * node.level + (node.module or ""), package_name or None)
        return [base] + [f"{base}.{alias.name}" for alias in node.names]
    return [node.args[0].value]


def attempt(problems, at, action):
    # runs action; a problem if it raised or tried a pinned package (even one whose ImportError it caught)
    before = len(reached)
    try:
        action()
    except Exception as error:
        problems.append(f"{at}: {type(error).__name__}: {error}")
        return False
    if len(reached) > before:
        problems.append(f"{at}: tried to import {sorted(set(reached[before:]))} (and went on without)")
    return True


def check(files):
    problems, seen, todo = [], set(), [Path(f).resolve() for f in files]
    module_spec = importlib.util.spec_from_file_location("checked_" + todo[0].stem, todo[0])
    attempt(problems, f"importing {shown(todo[0])}",
            lambda: module_spec.loader.exec_module(importlib.util.module_from_spec(module_spec)))
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        name, package_name = where(path)
        for node in ast.walk(ast.parse(path.read_text())):
            call = isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) in DYNAMIC
            if not (isinstance(node, (ast.Import, ast.ImportFrom)) or call):
                continue
            at = f"{shown(path)}:{node.lineno}: {ast.unparse(node)}"
            if call and not (node.args and isinstance(node.args[0], ast.Constant)):
                problems.append(f"{at}: a dynamic import this check cannot follow")
            elif call:
                attempt(problems, at, lambda: importlib.import_module(node.args[0].value))
            else:
                statement = compile(ast.Module(body=[node], type_ignores=[]), str(path), "exec")
                if attempt(problems, at, lambda: exec(statement, {"__name__": name, "__package__": package_name})):
                    todo += [ours(target) for target in imported_names(node, package_name) if ours(target)]
    return problems


print(json.dumps(check(task["files"])))
"""


def run_check(files: dict[str, list[Path]]) -> dict[str, list[str]]:
    """The problems found for each entry's files, each entry in an interpreter of its own (what one entry's imports
    leave loaded would hide another's), all at once."""
    pinned = sorted(pinned_packages())
    runs = {name: subprocess.Popen([sys.executable, "-c", CHECK, json.dumps(
        {"pinned": pinned, "repo": str(REPO), "files": [str(path) for path in paths]})],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO) for name, paths in files.items()}
    report = {}
    for name, run in runs.items():
        out, err = run.communicate(timeout=300)
        assert run.returncode == 0, f"{name}: {err[-4000:]}"
        report[name] = json.loads(out.splitlines()[-1])
    return report


def test_marked_modules_import_no_pinned_package(tmp_path):
    """Every marked module passes the check; a canary shows that it catches a pinned import inside a test function."""
    modules = marked_modules()
    assert modules, f"no test module is marked {MARKER}: the floors run would deselect nothing"
    problems, files = {}, {}
    for path in modules:
        name = str(path.relative_to(REPO))
        tree = ast.parse(path.read_text())
        imports = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        if "subprocess" in imports and name not in RUNS:
            problems[name] = ["imports subprocess but lists no scripts in RUNS (their imports would go unchecked)"]
        arguments = {arg.arg for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) for arg in node.args.args}
        if arguments & MODEL_FIXTURES:
            problems.setdefault(name, []).append(f"uses conftest.py's fixtures {sorted(arguments & MODEL_FIXTURES)}")
        files[name] = [path, *(REPO / script for script in RUNS.get(name, []))]
    pinned_in_a_function = "import torch\n\n\ndef test_x():\n    from transformers import AutoConfig\n"
    (tmp_path / "test_pinned.py").write_text(pinned_in_a_function)
    files["canary"] = [tmp_path / "test_pinned.py"]
    report = run_check(files)
    assert len(report.pop("canary")) == 1, report
    for name, found in report.items():
        problems.setdefault(name, []).extend(found)
    assert not any(problems.values()), json.dumps(problems, indent=1)
