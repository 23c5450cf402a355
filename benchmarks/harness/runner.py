"""One family's CPU benchmark, driven by its :class:`FamilyBenchmark` spec (``benchmarks/bench_<family>_cpu.py``).

Every family's run has the same skeleton: the command line (``--quick``, ``--output``, ``--threads``, ``--max-wait``,
``--max-redo``, ``--profile``, ``--compare-only``), the family's own sections (prefill, its mixer op against a
reference, ...), then the shared ones — cached decoding after a short and a long context, and the prefill overhead of
RoPE and Selective RoPE over NoPE — and last the family's interleaved comparison (Selective RoPE against NoPE, or FoX
against transformers' Llama), each section after waiting for a quiet machine; the targets; a profile of the
Selective RoPE overhead when its target is missed; the printed table; one JSON file with the keys ``benchmark, mode,
command, device, source, plan, model_config, <sections>, targets, all_targets_met, contention, total_wall_s`` (and
``warning`` when disturbed rounds were kept). A spec says only what differs.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from selective_rope.families import get_family

from .machine import BUSY_THRESHOLD, LoadProbe, Quiet, device_info, load_average, source_provenance, usable_cores
from .measure import (
    COMPARE_PLANS,
    decode_contexts,
    decode_result,
    num_parameters,
    position_embedding_overhead,
    prefill_rows,
    profile_overhead,
    selective_vs_nope,
)
from .report import (
    log,
    print_decode,
    print_footer,
    print_header,
    print_overhead,
    print_prefill_rows,
    print_selective_vs_nope,
    write_results,
)

Section = tuple[str, str, Callable[[], dict]]  # (results key, title, run)


@dataclass
class Run:
    """One run of a benchmark: its command line, thread count, plan and the ``Quiet`` every timing consults."""

    args: argparse.Namespace
    threads: int
    quiet: Quiet
    plan: dict


@dataclass
class Comparison:
    """An interleaved comparison of several models, run after the shared sections, or alone with ``--compare-only``
    (then written to ``output`` unless ``--output`` is given).

    Args:
        key: its key in the results.
        title: its section title (numbered in a whole run).
        run: ``(spec, run) -> section``; the section's ``"targets"`` follow the other targets.
        print_section: ``(section, number) -> None``.
        output: the JSON path of ``--compare-only``.
        header_title: the printed title of ``--compare-only`` (``{name}``: the benchmark's name).
        header_line: ``model_config record -> str``: the printed model line of ``--compare-only``.
        only_title: the section title when run alone (default ``title``).
        only_position_embedding: ``model_config["position_embedding"]`` when run alone (default: as a whole run).
        summary: ``model_config record -> str``, recorded as ``model_config["summary"]``.
    """

    key: str
    title: str
    run: Callable[[FamilyBenchmark, Run], dict]
    print_section: Callable[[dict, int], None]
    output: Path
    header_title: str
    header_line: Callable[[dict], str]
    only_title: str | None = None
    only_position_embedding: str | None = None
    summary: Callable[[dict], str] | None = None


@dataclass
class FamilyBenchmark:
    """What one family's CPU benchmark measures beyond the shared sections.

    Args:
        name: the benchmark's name (``"bench_gla_cpu"``), also the JSON's ``benchmark``.
        title: the printed title.
        family: the family's name in :data:`selective_rope.families.FAMILIES`.
        model_config: the config fields of the benchmarked model (``position_embedding`` aside).
        seed: the seed of every model built.
        root: the repository root (source files are hashed relative to it).
        sources: the family's source files the numbers depend on (the shared ones are added).
        default_output: the JSON path written by default.
        plans: ``{"quick": plan, "full": plan}``: lengths, repeats, rounds; the shared sections read
            ``decode_contexts, decode_steps, decode_steps_per_round, decode_warmup, overhead_len, overhead_rounds``.
        sections: ``run -> [(key, title, fn)]``: the family's sections, run first and numbered from 1.
        print_sections: ``results -> None``: prints them.
        targets: ``(results, plan) -> {name: target}``: the family's targets, listed first.
        rotary_inputs: ``T -> (x, q, k)`` for the first layer's rotary module alone.
        model_details: ``model -> dict``: config details recorded next to ``model_config``.
        model_line: ``model_config record -> str``: the printed model description.
        decode_goal: the largest ratio of ms/token at the longest context to the shortest (``None``: no target).
        overhead_goal: the largest prefill time of (Selective) RoPE over NoPE.
        overhead_informal: the overhead targets are informal (said in their names).
        add_arguments: more command-line arguments.
        before_run: ``(args, threads, quiet) -> exit status or None``: e.g. a worker process's own job.
        on_start: ``(results) -> None``: after the run's provenance is recorded.
        comparison: the interleaved comparison run last (``--compare-only``: alone).
    """

    name: str
    title: str
    family: str
    model_config: dict
    seed: int
    root: Path
    sources: list[str]
    default_output: Path
    plans: dict[str, dict]
    sections: Callable[[Run], list[Section]]
    print_sections: Callable[[dict], None]
    targets: Callable[[dict, dict], dict]
    rotary_inputs: Callable[[int], tuple]
    model_details: Callable[[torch.nn.Module], dict] = lambda model: {}
    model_line: Callable[[dict], str] = lambda cfg: ""
    decode_goal: float | None = None
    overhead_goal: float = 1.15
    overhead_informal: bool = False
    add_arguments: Callable[[argparse.ArgumentParser], None] = lambda parser: None
    before_run: Callable[[argparse.Namespace, int, Quiet], int | None] = lambda args, threads, quiet: None
    on_start: Callable[[dict], None] = lambda results: None
    comparison: Comparison | None = None
    description: str = field(default="")

    def build_model(self, position_embedding: str) -> torch.nn.Module:
        """The benchmarked model with ``position_embedding``, the same weights for every call (same seed)."""
        family = get_family(self.family)
        torch.manual_seed(self.seed)
        config = family.config_class(position_embedding=position_embedding, **self.model_config)
        return family.lm_class(config).eval()

    @property
    def vocab_size(self) -> int:
        return self.model_config["vocab_size"]


@dataclass(frozen=True)
class ScriptPaths:
    """Where a CPU benchmark script of the repository (``benchmarks/bench_<stem>_cpu.py``) writes.

    Args:
        root: the repository root (source files are hashed relative to it).
        default_output: ``benchmarks/results/<stem>_cpu.json``, the whole run's JSON.
        compare_output: ``benchmarks/results/<stem>_<comparison>_cpu.json``, the JSON of ``--compare-only``.
    """

    root: Path
    default_output: Path
    compare_output: Path


def script_paths(script: str | Path, stem: str, comparison: str = "selective_vs_nope") -> ScriptPaths:
    """The paths of the benchmark script at ``script`` (its ``__file__``), found from the script's own place in the
    repository: the installed harness cannot know where the checkout is."""
    root = Path(script).resolve().parents[1]
    results = root / "benchmarks" / "results"
    return ScriptPaths(root=root, default_output=results / f"{stem}_cpu.json",
                       compare_output=results / f"{stem}_{comparison}_cpu.json")


# --------------------------------------------------------------------------------------------------------------------
# the command line and a run's bookkeeping
# --------------------------------------------------------------------------------------------------------------------
def add_common_arguments(parser: argparse.ArgumentParser, default_output: Path) -> None:
    parser.add_argument("--quick", action="store_true", help="short smoke run (small sizes, few repeats)")
    parser.add_argument("--output", type=Path, default=default_output, help=f"JSON path (default {default_output})")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (default: the number of usable CPU cores)")
    parser.add_argument("--max-wait", type=float, default=None,
                        help="seconds in all to wait for other processes to go quiet (default 180, quick 10)")
    parser.add_argument("--max-redo", type=int, default=None,
                        help="disturbed rounds run again per measurement (default 8, quick 1)")
    parser.add_argument("--profile", action="store_true",
                        help="always profile the Selective RoPE overhead (done anyway when its target is missed)")
    parser.add_argument("--compare-only", action="store_true",
                        help="only the interleaved comparison section (see the script's description)")


def configure(args: argparse.Namespace, seed: int) -> tuple[int, Quiet]:
    """Threads, seed and the quiet-waiting budget from the command line: the thread count asked for and the run's
    ``Quiet``."""
    threads = args.threads or usable_cores()
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    quiet = Quiet(max_wait_s=args.max_wait if args.max_wait is not None else (10.0 if args.quick else 180.0),
                  max_redo=args.max_redo if args.max_redo is not None else (1 if args.quick else 8))
    return threads, quiet


def start_results(name: str, args: argparse.Namespace, threads: int, root: Path, source_files: list[str],
                  plan: dict) -> dict:
    return {"benchmark": name, "mode": "quick" if args.quick else "full",
            "command": " ".join(["python", os.path.relpath(sys.argv[0], root), *sys.argv[1:]]),
            "device": device_info(threads), "source": source_provenance(root, source_files), "plan": plan}


def run_sections(results: dict, sections: list[Section], quiet: Quiet) -> dict:
    """Run ``(key, title, fn)`` sections in turn, each after waiting for a quiet machine; ``results[key] = fn()``.

    Returns the per-section contention record: wall time, cores kept busy by other processes (waits included) and
    the load average before and after.
    """
    contention: dict = {}
    for key, title, run in sections:
        log(title)
        load_before = load_average()
        quiet.wait()
        probe = LoadProbe()
        start = time.perf_counter()
        results[key] = run()
        busy = probe.others_cores()
        contention[key] = {"wall_s": round(time.perf_counter() - start, 2),
                           "others_cores": None if busy is None else round(busy, 2),
                           "load_average_before": load_before, "load_average_after": load_average()}
    return contention


def finish(results: dict, contention: dict, start_all: float, quiet: Quiet) -> None:
    """Contention summary, end load, total wall time and (when disturbed rounds were kept) a warning."""
    contention["quiet"] = quiet.summary()
    results["contention"] = contention
    results["device"]["load_average_end"] = load_average()
    results["total_wall_s"] = round(time.perf_counter() - start_all, 2)
    busy = {key: c["others_cores"] for key, c in contention.items() if "others_cores" in c}
    if quiet.disturbed_rounds_kept:
        results["warning"] = (f"{quiet.disturbed_rounds_kept} timed rounds ran while other processes kept more than "
                              f"{BUSY_THRESHOLD} cores busy and were kept (no redo left; cores busy per section, "
                              f"waits included: {busy}): absolute timings may be inflated; the interleaved ratios "
                              "are less affected")


# --------------------------------------------------------------------------------------------------------------------
# sections more than one family uses
# --------------------------------------------------------------------------------------------------------------------
def prefill_section(spec: FamilyBenchmark, run: Run) -> dict:
    """Prefill throughput of the Selective RoPE model (``use_cache=True``) at the plan's ``prefill_lengths``."""
    rows = prefill_rows(spec.build_model("selective_rope"), run.plan["prefill_lengths"], spec.vocab_size,
                        run.plan["prefill_repeats"], run.quiet, use_cache=True)
    return {"position_embedding": "selective_rope", "batch_size": 1, "use_cache": True, "warmup": 1, "rows": rows}


def print_prefill_section(results: dict, number: int) -> None:
    log(f"{number}. Prefill throughput (selective_rope, use_cache=True)")
    print_prefill_rows(results["prefill"]["rows"])


def selective_vs_nope_comparison(output: Path) -> Comparison:
    """Selective RoPE against NoPE, the same model: decode and prefill interleaved, paired ratios (the plan holds
    :data:`~.measure.COMPARE_PLANS`)."""
    return Comparison(
        key="compare", title="Selective RoPE vs NoPE: decode and prefill, interleaved",
        only_title="Selective RoPE vs NoPE (decode and prefill, interleaved)",
        run=lambda spec, run: selective_vs_nope(spec.build_model, spec.vocab_size, run.plan, run.quiet),
        print_section=print_selective_vs_nope, output=output, header_title="{name}: Selective RoPE vs NoPE",
        header_line=lambda cfg: f"model: {cfg.get('summary', '')}",
        summary=lambda cfg: (f"hidden {cfg['hidden_size']}, layers {cfg['num_hidden_layers']}, heads "
                             f"{cfg['num_heads']}, vocab {cfg['vocab_size']}, {cfg['num_parameters']:,} params, fp32, "
                             "batch 1"))


def with_compare_plans(plans: dict[str, dict]) -> dict[str, dict]:
    """``plans`` with the Selective RoPE vs NoPE comparison's own entries."""
    return {mode: {**plan, **COMPARE_PLANS[mode]} for mode, plan in plans.items()}


# --------------------------------------------------------------------------------------------------------------------
# a whole run
# --------------------------------------------------------------------------------------------------------------------
def run_benchmark(spec: FamilyBenchmark, argv: list[str] | None = None) -> int:
    """Run ``spec``'s benchmark with the command line ``argv``; returns the exit status.

    The run sets torch's intra-op thread count (``--threads``) for itself only: the caller's count is restored when
    it returns or raises (a benchmark run in-process, as the tests do, must not change later timings).
    """
    parser = argparse.ArgumentParser(description=spec.description, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(parser, spec.default_output)
    spec.add_arguments(parser)
    args = parser.parse_args(argv)
    if args.compare_only:
        if spec.comparison is None:
            parser.error(f"{spec.name} has no comparison section for --compare-only")
        if args.output == spec.default_output:
            args.output = spec.comparison.output
    threads_before = torch.get_num_threads()
    try:
        return _run(spec, args)
    finally:
        torch.set_num_threads(threads_before)


def _run(spec: FamilyBenchmark, args: argparse.Namespace) -> int:
    """The run of :func:`run_benchmark` after its command line is read."""
    comparison = spec.comparison
    threads, quiet = configure(args, spec.seed)
    status = spec.before_run(args, threads, quiet)
    if status is not None:
        return status

    plan = spec.plans["quick" if args.quick else "full"]
    run = Run(args=args, threads=threads, quiet=quiet, plan=plan)
    own_sections = spec.sections(run)
    decode_number, overhead_number = len(own_sections) + 1, len(own_sections) + 2

    start_all = time.perf_counter()
    results = start_results(spec.name, args, threads, spec.root, spec.sources, plan)
    spec.on_start(results)
    probe = spec.build_model("selective_rope")
    results["model_config"] = cfg = {
        **spec.model_config,
        "position_embedding": f"selective_rope (sections 1-{decode_number}); all three in {overhead_number}",
        **spec.model_details(probe), "num_parameters": num_parameters(probe), "dtype": "float32", "seed": spec.seed,
        "full_config": probe.config.to_diff_dict()}
    del probe
    if comparison is not None and comparison.summary is not None:
        cfg["summary"] = comparison.summary(cfg)
    if args.compare_only:
        return _run_comparison_alone(spec, comparison, run, results, start_all)

    log(f"[{spec.name}] mode={results['mode']} threads={torch.get_num_threads()} "
        f"load avg={results['device']['load_average_start']}")
    decode = (f"{decode_number}. decode latency", lambda: decode_result(
        decode_contexts(spec.build_model("selective_rope"), plan["decode_contexts"], spec.vocab_size,
                        plan["decode_steps"], plan["decode_steps_per_round"], plan["decode_warmup"], quiet),
        plan["decode_steps_per_round"], plan["decode_warmup"], spec.decode_goal))
    overhead = (f"{overhead_number}. position-embedding overhead", lambda: position_embedding_overhead(
        spec.build_model, plan["overhead_len"], spec.vocab_size, plan["overhead_rounds"], spec.rotary_inputs,
        spec.overhead_goal, spec.seed, quiet, use_cache=True))
    sections = [*own_sections, ("decode", *decode), ("overhead", *overhead)]
    if comparison is not None:
        sections.append((comparison.key, f"{overhead_number + 1}. {comparison.title}",
                         lambda: comparison.run(spec, run)))
    contention = run_sections(results, sections, quiet)

    informal = " (informal)" if spec.overhead_informal else ""
    results["targets"] = dict(spec.targets(results, plan))
    if spec.decode_goal is not None:
        results["targets"][f"decode {results['decode']['ratio_name']}"] = results["decode"]["ratio_target"]
    results["targets"].update({
        f"selective_rope / nope prefill time at T={plan['overhead_len']}{informal}":
            results["overhead"]["selective_rope_over_nope"],
        f"rope / nope prefill time at T={plan['overhead_len']}{informal}": results["overhead"]["rope_over_nope"],
    })
    if comparison is not None:
        results["targets"].update(results[comparison.key]["targets"])
    results["all_targets_met"] = all(t["met"] for t in results["targets"].values())
    if args.profile or not results["overhead"]["selective_rope_over_nope"]["met"]:
        log("profiling the Selective RoPE overhead (torch.profiler)")
        results["overhead"]["profile"] = profile_overhead(spec.build_model, plan["overhead_len"], spec.vocab_size,
                                                          spec.rotary_inputs, quiet, use_cache=True)
    finish(results, contention, start_all, quiet)

    line = print_header(results, spec.title, spec.model_line(cfg))
    spec.print_sections(results)
    print_decode(results["decode"], decode_number)
    print_overhead(results["overhead"], overhead_number)
    if comparison is not None:
        comparison.print_section(results[comparison.key], overhead_number + 1)
    print_footer(results, line)
    write_results(args.output, results)
    return 0


def _run_comparison_alone(spec: FamilyBenchmark, comparison: Comparison, run: Run, results: dict,
                          start_all: float) -> int:
    """``--compare-only``: the comparison section alone, printed and written to ``run.args.output``."""
    if comparison.only_position_embedding is not None:
        results["model_config"]["position_embedding"] = comparison.only_position_embedding
    contention = run_sections(results, [(comparison.key, comparison.only_title or comparison.title,
                                         lambda: comparison.run(spec, run))], run.quiet)
    results["targets"] = results[comparison.key]["targets"]
    results["all_targets_met"] = all(t["met"] for t in results["targets"].values())
    finish(results, contention, start_all, run.quiet)
    line = print_header(results, comparison.header_title.format(name=spec.name),
                        comparison.header_line(results["model_config"]))
    comparison.print_section(results[comparison.key], 1)
    print_footer(results, line)
    write_results(run.args.output, results)
    return 0
