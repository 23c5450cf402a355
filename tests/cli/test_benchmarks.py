"""The benchmark harness (benchmarks/harness/, a tool of the repository, not of the installed package): a family
spec's whole run at tiny sizes writes the record every CPU benchmark writes, with the shared sections after the
family's own, numbered in turn."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from harness.machine import Quiet
from harness.runner import (
    FamilyBenchmark,
    prefill_section,
    print_prefill_section,
    run_benchmark,
    script_paths,
    selective_vs_nope_comparison,
)
from harness.timing import paired_ratio, target, timed_rounds

TINY = dict(hidden_size=32, num_hidden_layers=1, num_heads=2, vocab_size=64, use_short_conv=True)
PLAN = {"prefill_lengths": [8, 16], "prefill_repeats": 1, "decode_contexts": [4, 12], "decode_steps": 2,
        "decode_steps_per_round": 1, "decode_warmup": 1, "overhead_len": 8, "overhead_rounds": 1}


def rotary_inputs(T: int):
    return torch.randn(1, T, 32), torch.randn(1, T, 2, 8), torch.randn(1, T, 2, 8)


def test_a_family_spec_runs_the_shared_sections_after_its_own(tmp_path, capsys):
    seen = {}

    def sections(run):
        seen["quiet"] = run.quiet
        return [("prefill", "1. prefill throughput", lambda: prefill_section(spec, run))]

    spec = FamilyBenchmark(
        name="bench_tiny", title="tiny", family="gla", model_config=TINY, seed=0, root=tmp_path,
        sources=["missing.py"], default_output=tmp_path / "default.json", plans={"quick": PLAN, "full": PLAN},
        sections=sections, print_sections=lambda results: print_prefill_section(results, 1),
        targets=lambda results, plan: {"prefill rows": target(len(results["prefill"]["rows"]), 2, True)},
        rotary_inputs=rotary_inputs, decode_goal=100.0)
    output = tmp_path / "out.json"
    assert run_benchmark(spec, ["--quick", "--output", str(output), "--threads", "1", "--max-wait", "0"]) == 0
    results = json.loads(output.read_text())
    assert list(results)[:10] == ["benchmark", "mode", "command", "device", "source", "plan", "model_config",
                                  "prefill", "decode", "overhead"]
    assert results["benchmark"] == "bench_tiny" and results["mode"] == "quick" and results["plan"] == PLAN
    assert results["model_config"]["position_embedding"] == "selective_rope (sections 1-2); all three in 3"
    assert [row["seq_len"] for row in results["prefill"]["rows"]] == [8, 16]
    assert [row["context"] for row in results["decode"]["rows"]] == [4, 12]
    assert set(results["overhead"]["timings"]) == {"nope", "rope", "selective_rope"}
    assert list(results["targets"]) == ["prefill rows", "decode ms/token at 12 / at 4",
                                        "selective_rope / nope prefill time at T=8",
                                        "rope / nope prefill time at T=8"]
    assert results["targets"]["prefill rows"]["met"]
    assert results["contention"]["quiet"] == seen["quiet"].summary()
    out = capsys.readouterr().out
    for title in ("1. Prefill throughput", "2. Decode", "3. Position-embedding prefill overhead", "Targets"):
        assert title in out


def test_compare_only_runs_the_comparison_alone_into_its_own_file(tmp_path, capsys):
    compare_plan = {**PLAN, "compare_decode_contexts": [4, 8], "compare_decode_rounds": 2,
                    "compare_decode_steps_per_round": 1, "compare_decode_warmup": 1,
                    "compare_prefill_lengths": [8, 16], "compare_prefill_rounds": 2}
    spec = FamilyBenchmark(
        name="bench_tiny", title="tiny", family="gla", model_config=TINY, seed=0, root=tmp_path, sources=[],
        default_output=tmp_path / "full.json", plans={"quick": compare_plan, "full": compare_plan},
        sections=lambda run: [], print_sections=lambda results: None, targets=lambda results, plan: {},
        rotary_inputs=rotary_inputs, comparison=selective_vs_nope_comparison(tmp_path / "compare.json"))
    assert run_benchmark(spec, ["--quick", "--compare-only", "--threads", "1", "--max-wait", "0"]) == 0
    assert not (tmp_path / "full.json").exists()
    results = json.loads((tmp_path / "compare.json").read_text())
    assert "decode" not in results and "overhead" not in results
    assert [row["context"] for row in results["compare"]["decode"]["rows"]] == [4, 8]
    assert [row["seq_len"] for row in results["compare"]["prefill"]["rows"]] == [8, 16]
    for row in results["compare"]["decode"]["rows"] + results["compare"]["prefill"]["rows"]:
        assert set(row["models"]) == {"nope", "selective_rope"}
        assert row["models"]["selective_rope"]["ratio_to_nope"]["pairs"] == 2  # two interleaved rounds, paired
    assert list(results["targets"]) == ["selective_rope / nope decode ms/token at context 4",
                                        "selective_rope / nope decode ms/token at context 8",
                                        "selective_rope / nope prefill at T=8", "selective_rope / nope prefill at T=16"]
    assert results["model_config"]["summary"].startswith("hidden 32, layers 1, heads 2")
    assert "bench_tiny: Selective RoPE vs NoPE" in capsys.readouterr().out


def test_a_run_restores_the_callers_thread_count(tmp_path):
    """``--threads`` holds for the run only, whether it returns or raises (the count is process-wide in torch)."""

    def sections(run):
        assert torch.get_num_threads() == 1  # the run's own count while it runs
        if run.args.output.name == "fails.json":
            raise RuntimeError("a section failed")
        return []

    spec = FamilyBenchmark(
        name="bench_tiny", title="tiny", family="gla", model_config=TINY, seed=0, root=tmp_path, sources=[],
        default_output=tmp_path / "out.json", plans={"quick": PLAN, "full": PLAN}, sections=sections,
        print_sections=lambda results: None, targets=lambda results, plan: {}, rotary_inputs=rotary_inputs)
    torch.set_num_threads(3)  # the caller's count, other than the run's (tests/conftest.py restores the original)
    assert run_benchmark(spec, ["--quick", "--threads", "1", "--max-wait", "0"]) == 0
    assert torch.get_num_threads() == 3
    with pytest.raises(RuntimeError, match="a section failed"):
        run_benchmark(spec, ["--quick", "--threads", "1", "--max-wait", "0", "--output", str(tmp_path / "fails.json")])
    assert torch.get_num_threads() == 3


def test_script_paths_are_found_from_the_scripts_place_in_the_repository(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path / "..")  # not the repository: the paths must not depend on the working directory
    paths = script_paths(tmp_path / "benchmarks" / "bench_gla_cpu.py", "gla")
    assert paths.root == tmp_path.resolve()
    assert paths.default_output == tmp_path.resolve() / "benchmarks" / "results" / "gla_cpu.json"
    assert paths.compare_output == tmp_path.resolve() / "benchmarks" / "results" / "gla_selective_vs_nope_cpu.json"
    fox = script_paths(tmp_path / "benchmarks" / "bench_fox_cpu.py", "fox", comparison="vs_llama")
    assert fox.compare_output.name == "fox_vs_llama_cpu.json"


def test_timed_rounds_interleave_and_pair_the_calls():
    order = []
    stats = timed_rounds({"a": lambda: order.append("a"), "b": lambda: order.append("b")}, rounds=4,
                         quiet=Quiet(max_wait_s=0, max_redo=0), calls=1, warmup=0, min_round_s=0)
    assert order == ["a", "b", "b", "a", "a", "b", "b", "a"]  # the first function rotates each round
    assert stats["a"]["repeats"] == stats["b"]["repeats"] == 4
    assert paired_ratio({"x": {"times_s": [2, 4]}, "y": {"times_s": [1, 1]}}, "x", "y") == 3


def test_the_width_script_compares_each_family_at_each_width(tmp_path, capsys):
    """``benchmarks/bench_decode_width_cpu.py`` (a script, loaded from its file): one interleaved decode comparison
    per family and width, NoPE first, ratios paired by round; the caller's thread count is restored."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_decode_width_cpu.py"
    spec = importlib.util.spec_from_file_location("bench_decode_width_cpu", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    threads = torch.get_num_threads()
    output = tmp_path / "width.json"
    assert script.main(["--quick", "--widths", "256", "--output", str(output), "--threads", "1",
                        "--max-wait", "0"]) == 0
    assert torch.get_num_threads() == threads
    results = json.loads(output.read_text())
    assert [(row["family"], row["hidden_size"]) for row in results["rows"]] == [("gla", 256), ("gated_deltanet", 256)]
    for row in results["rows"]:
        assert row["num_parameters"]["selective_rope"] > row["num_parameters"]["nope"]
        (decode,) = row["decode"]["rows"]
        assert decode["context"] == 16 and decode["models"]["selective_rope"]["ratio_to_nope"]["pairs"] == 4
    assert "gated_deltanet |    256" in capsys.readouterr().out


def test_the_bf16_precision_script_compares_both_dtypes_and_runs_every_ablation(tmp_path):
    """``benchmarks/bf16_precision.py`` at tiny lengths: per family and length the bf16 against float32 statistics,
    and one row per ablation (the rounded phase input of the code before the bf16 fix included)."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "bf16_precision.py"
    spec = importlib.util.spec_from_file_location("bf16_precision", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    threads = torch.get_num_threads()
    output = tmp_path / "bf16.json"
    script.main(["--lengths", "32", "64", "--families", "gla", "fox", "--ablations", "--ablation-length", "48",
                 "--threads", "1", "--output", str(output)])
    assert torch.get_num_threads() == threads
    results = json.loads(output.read_text())
    assert list(results["families"]) == ["gla", "fox"] and list(results["ablations"]) == ["gla", "fox"]
    for family in ("gla", "fox"):
        assert list(results["families"][family]["lengths"]) == ["32", "64"]
        assert list(results["ablations"][family]) == script.ABLATIONS
        for row in [*results["families"][family]["lengths"].values(), *results["ablations"][family].values()]:
            assert 0 < row["mean_abs"] <= row["max_abs"] and 0 <= row["argmax_agreement"] <= 1
    # the float32 model's phase increments really replace the bf16 model's: a different result from the baseline's
    assert results["ablations"]["gla"]["phase_exact"] != results["ablations"]["gla"]["baseline"]


def test_the_host_time_script_times_every_case_in_its_own_process():
    """``benchmarks/host_time_cpu.py`` replaces our Triton kernels with no-op launchers for good, so it runs in a
    process of its own; one tiny round prints a line per case (the script's API use stays in step with the code)."""
    import subprocess
    import sys

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "host_time_cpu.py"
    done = subprocess.run([sys.executable, str(path), "--rounds", "2", "--calls", "1"], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    for case in ("decode fox rope", "decode fox selective_rope", "decode gla rope", "decode gla selective_rope",
                 "train eager autograd", "train custom op", "layer fox selective_rope"):
        assert f"  {case} " in done.stdout, done.stdout


def test_results_are_written_whole_or_not_at_all(tmp_path, monkeypatch):
    """A benchmark rewrites its JSON after every row; a write that fails (a kill, a full disk) must leave the previous
    file as it was, and no partial file beside it."""
    import os

    from harness.report import write_results

    path = tmp_path / "results.json"
    write_results(path, {"rows": [1]})
    assert json.loads(path.read_text()) == {"rows": [1]}
    assert oct(path.stat().st_mode & 0o777) == oct(0o666 & ~_umask())
    write_results(path, {"rows": [1, 2]})
    assert json.loads(path.read_text()) == {"rows": [1, 2]}

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_results(path, {"rows": [1, 2, 3]})
    assert json.loads(path.read_text()) == {"rows": [1, 2]}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json"]


def _umask() -> int:
    import os

    current = os.umask(0)
    os.umask(current)
    return current


def test_the_committed_performance_page_is_what_the_results_give():
    """docs/performance.md is generated from benchmarks/results/ by benchmarks/performance_page.py: a page edited by
    hand, or results rerun without regenerating it, fail here."""
    import performance_page

    if not (performance_page.RESULTS / "fox_vs_llama_cpu.json").exists():
        pytest.skip("no benchmarks/results/ here (an unpacked sdist leaves them out)")
    expected = performance_page.page()
    assert performance_page.PAGE.read_text() == expected, "run: python benchmarks/performance_page.py"
    assert "benchmarks/results/fox_vs_llama_cpu.json" in expected and "fox_selective" in expected


def test_the_gpu_targets_script_reads_a_gpu_check_calls_results(tmp_path, capsys):
    """``benchmarks/gpu_targets.py`` on the H200 results of 28 Nov 2026 (committed): FoX's figures as the lead read
    them (0.739x NoPE, +9.8 GiB, packed 0.954x dense); a folder with nothing measured says so."""
    spec = importlib.util.spec_from_file_location(
        "gpu_targets", Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_targets.py")
    gpu_targets = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_targets)
    results = Path(__file__).resolve().parents[2] / "benchmarks/results/gpu/2026-11-28-h200/call1-c786278"
    assert gpu_targets.main([str(results), "--output", str(tmp_path / "targets.json")]) == 0
    targets = {t["target"]: (t["value"], t["met"]) for t in json.loads((tmp_path / "targets.json").read_text())}
    assert targets["fox: Selective RoPE / NoPE training tokens/s"] == (0.7389, False)
    assert targets["fox: Selective RoPE peak memory over NoPE's (GiB)"] == (9.82, False)
    assert targets["fox: Selective RoPE packed / dense training tokens/s"] == (0.9539, True)
    assert targets["gla: Selective RoPE / NoPE training tokens/s"] == (0.6921, False)
    capsys.readouterr()
    assert gpu_targets.main([str(tmp_path)]) == 0
    assert "nothing measured" in capsys.readouterr().out
