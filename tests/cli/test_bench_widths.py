"""``benchmarks/bench_widths_cpu.py`` (issue 51), loaded from its file: a small run writes every section it was asked
for, with paired ratios and load averages, and restores the caller's thread count; its ``--before`` model (the code
before issue 51, kept in the script) trains to the same gradients as the package's, bit for bit."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_widths_cpu.py"


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("bench_widths_cpu", PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_small_run_writes_the_sections_asked_for(script, tmp_path):
    threads = torch.get_num_threads()
    output = tmp_path / "widths.json"
    assert script.main(["--quick", "--families", "gla", "--widths", "64", "--sections", "decode", "train", "rotary",
                        "--before", "--no-peer", "--rounds", "1", "--output", str(output)]) == 0
    assert torch.get_num_threads() == threads
    results = json.loads(output.read_text())
    (row,) = results["rows"]
    assert (row["family"], row["hidden_size"], row["prefill"]) == ("gla", 64, [])
    assert set(row["train"]["models"]) == {"nope", "rope", "selective_rope", "nope_twin", "selective_rope_before"}
    for section in (row["decode"], row["train"]):
        assert len(section["load_average_1min"]) == 2
        ratio = section["models"]["selective_rope"]["wall_ratio_to_nope"]
        assert ratio["q1"] <= ratio["median"] <= ratio["q3"]
    assert set(row["rotary_module_train"]["forward_backward"]) == set(script.ROTARY_VARIANTS)
    assert results["peers"] == [] and results["threads"] == 1


def test_bad_arguments_are_refused(script, capsys):
    for argv in (["--threads", "0"], ["--rounds", "0"], ["--widths", "128"]):
        with pytest.raises(SystemExit):
            script.main(argv)
    assert "--rounds must be at least 1, got 0" in capsys.readouterr().err


@pytest.mark.parametrize("family", ["gla", "fox"])
def test_the_before_model_trains_to_the_same_gradients(script, family):
    ids = script.random_ids(2, 16, 0)
    grads = []
    for model in (script.build(family, 64, "selective_rope"),
                  script.before_issue_51(script.build(family, 64, "selective_rope"))):
        model.train()
        model(ids, labels=ids).loss.backward()
        grads.append({name: p.grad for name, p in model.named_parameters()})
    patched = [m for m in model.modules() if "_normalized_chunks" in m.__dict__]
    assert len(patched) == model.config.num_hidden_layers  # the before model does run the old code
    assert grads[0].keys() == grads[1].keys()
    assert all(torch.equal(grads[0][name], grads[1][name]) for name in grads[0])
