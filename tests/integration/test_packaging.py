"""Packaging: the role folders are mapped into `selective_rope` by setuptools (no links in the tree), a wheel carries
every sub-package and the card templates, a model saved from a wheel install loads with trust_remote_code, and a
source tree that is not installed says how to install it."""

from __future__ import annotations

import shutil
import site
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

try:
    import tomllib  # Python >= 3.11
except ModuleNotFoundError:
    tomllib = pytest.importorskip("tomli")

REPO = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
# What a build reads: the metadata files and the package folders pyproject names.
BUILD_INPUTS = ["pyproject.toml", "README.md", "LICENSE", "MANIFEST.in", "selective_rope",
                *PYPROJECT["tool"]["setuptools"]["package-dir"].values()]


def _python_without_install(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """Python with site-packages on the path but no .pth hooks run (so no editable install of ours is active)."""
    paths = [path for path in (*site.getsitepackages(), site.getusersitepackages()) if Path(path).is_dir()]
    prelude = f"import sys; sys.path[1:1] = {paths!r}; "
    return subprocess.run([sys.executable, "-S", "-c", prelude + args[0], *args[1:]], cwd=cwd, capture_output=True,
                          text=True, timeout=600)


def test_every_sub_package_maps_onto_a_repository_folder_and_nothing_is_a_link():
    setuptools = PYPROJECT["tool"]["setuptools"]
    assert set(setuptools["packages"]) == {"selective_rope", *setuptools["package-dir"]}
    for package, folder in setuptools["package-dir"].items():
        assert package == f"selective_rope.{folder}" and (REPO / folder / "__init__.py").is_file(), package
    links = [str(path) for root in ("selective_rope", *setuptools["package-dir"].values())
             for path in (REPO / root).rglob("*") if path.is_symlink()]
    assert not links and not (REPO / "selective_rope").is_symlink()
    assert (REPO / "LICENSE").read_text().startswith("MIT License") and PYPROJECT["project"]["license"] == "MIT"


def test_a_source_tree_that_is_not_installed_says_how_to_install(tmp_path):
    shutil.copytree(REPO / "selective_rope", tmp_path / "selective_rope")  # as in a checkout: no sub-packages inside
    run = _python_without_install("import selective_rope", cwd=tmp_path)
    assert run.returncode != 0
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("ModuleNotFoundError: selective_rope was imported from ") and "pip install -e ." in last


@pytest.mark.slow
def test_a_wheel_installs_every_part_and_its_saved_models_load_as_remote_code(tmp_path):
    """Build the wheel (setuptools, no network), install it into a folder, then in fresh processes: import it from
    there, save a model (its flat code bundle read from the installed files), load it with trust_remote_code where
    selective_rope cannot be imported."""
    source = tmp_path / "source"  # a copy, so that the build's own files (build/, *.egg-info) stay out of the tree
    source.mkdir()
    for name in BUILD_INPUTS:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(REPO / name, source / name)
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                            str(tmp_path / "dist"), str(source)], capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr
    wheel = next((tmp_path / "dist").glob("selective_rope-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    for package in PYPROJECT["tool"]["setuptools"]["packages"]:
        assert f"{package.replace('.', '/')}/__init__.py" in names, package
    cards = {f"selective_rope/model_cards/selective_rope_{family}.md" for family in ("gla", "gated_deltanet", "fox")}
    assert cards <= names and any(name.endswith("licenses/LICENSE") for name in names)
    assert not any(name.startswith("tests/") for name in names)

    target = tmp_path / "installed"
    install = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target),
                              str(wheel)], capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, install.stderr
    save = textwrap.dedent(f"""
        sys.path.insert(0, {str(target)!r})
        import torch, selective_rope
        from selective_rope import SelectiveRopeFoXConfig, SelectiveRopeFoXForCausalLM
        assert selective_rope.__file__.startswith({str(target)!r}), selective_rope.__file__
        torch.manual_seed(0)
        model = SelectiveRopeFoXForCausalLM(SelectiveRopeFoXConfig(vocab_size=61, hidden_size=32, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2, intermediate_size=48)).eval()
        model.save_pretrained({str(tmp_path / "model")!r}, model_card=True)
        ids = torch.arange(3, 13)[None]
        torch.save(model(ids).logits, {str(tmp_path / "logits.pt")!r})
    """)
    run = _python_without_install(save, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "trust_remote_code" in (tmp_path / "model" / "README.md").read_text()  # the card template shipped

    load = textwrap.dedent(f"""
        import importlib.abc
        class Blocked(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "selective_rope":
                    raise ImportError("blocked")
        sys.meta_path.insert(0, Blocked())
        import torch
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained({str(tmp_path / "model")!r}, trust_remote_code=True).eval()
        assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
        expected = torch.load({str(tmp_path / "logits.pt")!r})
        assert torch.equal(model(torch.arange(3, 13)[None]).logits, expected)
    """)
    run = _python_without_install(load, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
