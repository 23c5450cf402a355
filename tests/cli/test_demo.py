"""The main job (a very short run) and the command line."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from selective_rope import SelectiveRopeGLAForCausalLM
from selective_rope.cli import main
from selective_rope.demo import BOS, MODULUS, demo_config, progressions, run_demo
from selective_rope.families import FAMILY_NAMES


def test_progressions_are_arithmetic():
    ids = progressions(5, 10, torch.Generator().manual_seed(0))
    assert (ids[:, 0] == BOS).all()
    steps = (ids[:, 2:] - ids[:, 1:-1]) % MODULUS
    assert (steps == steps[:, :1]).all() and (steps > 0).all()


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_demo_trains_saves_reloads_and_generates(tmp_path, capsys, family):
    result = run_demo(str(tmp_path / "out"), seconds=30, max_steps=3, seed=0, family=family)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert reloaded.config.model_type == f"selective_rope_{family}"
    assert len(result["generated"]) == 6 and 0.0 <= result["accuracy"] <= 1.0
    assert f"reloaded as {type(reloaded).__name__}" in capsys.readouterr().out


def test_the_hybrid_demo_has_both_layer_kinds():
    assert demo_config("hybrid").layer_types == ["linear_attention", "full_attention"]


def test_demo_default_family_is_gla():
    assert isinstance(AutoModelForCausalLM.from_config(demo_config()), SelectiveRopeGLAForCausalLM)


def test_cli_rejects_bad_arguments():
    with pytest.raises(SystemExit, match="positive"):
        main(["demo", "--seconds", "0"])
    with pytest.raises(SystemExit):
        main(["no-such-command"])
    with pytest.raises(SystemExit):
        main(["demo", "--family", "mamba"])


def test_module_entry_point_help():
    result = subprocess.run([sys.executable, "-m", "selective_rope", "demo", "--help"], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0 and "arithmetic" in result.stdout


@pytest.mark.parametrize("seconds, max_steps", [(1e-9, 50), (600, 3)], ids=["time-budget", "max-steps"])
def test_the_progress_bar_ends_full_whichever_limit_stops_training(capsys, seconds, max_steps):
    """The bar ends at 100 % of the steps actually taken, and says so when the time budget stopped training early."""
    from selective_rope.demo import train

    model = AutoModelForCausalLM.from_config(demo_config())
    train(model, seconds, max_steps, torch.Generator().manual_seed(0), batch=2, length=6)
    last = re.split(r"[\r\n]+", capsys.readouterr().err.strip())[-1]
    steps = 1 if seconds < 1 else max_steps
    assert "100%" in last and f"{steps}/{steps}" in last, last
    assert ("budget reached" in last) == (seconds < 1), last
