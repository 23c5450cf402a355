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


@pytest.mark.parametrize("seconds, max_steps", [(1e-9, 50), (600, 3)], ids=["time-cap", "max-steps"])
def test_the_progress_bar_ends_full_whichever_limit_stops_training(capsys, seconds, max_steps):
    """The bar ends at 100 % of the steps actually taken, and says so when the time cap stopped training early."""
    from selective_rope.demo import train

    model = AutoModelForCausalLM.from_config(demo_config())
    _, taken = train(model, seconds, max_steps, torch.Generator().manual_seed(0), batch=2, length=6)
    last = re.split(r"[\r\n]+", capsys.readouterr().err.strip())[-1]
    steps = 1 if seconds < 1 else max_steps
    assert taken == steps
    assert "100%" in last and f"{steps}/{steps}" in last, last
    assert ("cap reached" in last) == (seconds < 1), last


@pytest.mark.parametrize("accuracy, steps, learned, advice", [
    (0.95, 400, True, None),
    (0.90, 400, True, None),              # the threshold itself counts as learned
    (0.04, 10, False, "--seconds"),       # the time cap stopped it: more time
    (0.50, 400, False, "--max-steps"),    # every step ran: more steps
])
def test_verdict(accuracy, steps, learned, advice):
    from selective_rope.demo import LEARNED_ACCURACY, verdict

    assert LEARNED_ACCURACY == 0.9
    ok, line = verdict(accuracy, 0.03, steps, max_steps=400, seconds=60)
    assert ok is learned
    assert line.startswith("learned: " if learned else "did NOT learn: "), line
    assert f"{accuracy:.1%}" in line and "3.0% before" in line and f"after {steps} training steps" in line
    assert advice is None or advice in line
    if steps < 400:
        assert "60 s time cap stopped training at step 10 of 400" in line


def test_the_command_exits_1_with_the_verdict_when_the_model_did_not_learn(tmp_path, capsys):
    status = main(["demo", "--max-steps", "1", "--output-dir", str(tmp_path / "out")])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert status == 1 and last.startswith("did NOT learn: ") and "after 1 training steps" in last


def test_the_demo_trains_on_one_thread_and_restores_the_callers_count(tmp_path, monkeypatch):
    import selective_rope.demo as demo

    seen = []
    real_train = demo.train
    monkeypatch.setattr(demo, "train", lambda *a, **k: (seen.append(torch.get_num_threads()), real_train(*a, **k))[1])
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        run_demo(str(tmp_path / "out"), seconds=30, max_steps=1)
        assert seen == [1] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_the_default_demo_learns(tmp_path, family):
    """The default run (600 steps) learns the task for every family: the claim the verdict makes."""
    assert main(["demo", "--family", family, "--output-dir", str(tmp_path / "out")]) == 0
