"""The machine a benchmark runs on: what it is (``device_info``, ``source_provenance``) and how busy other processes
keep it.

With ``torch.set_num_threads(cores)``, one other busy process makes every multi-threaded op wait for a descheduled
OpenMP thread, and timings inflate by 10-100x. ``LoadProbe`` reads ``/proc/stat`` to tell how many cores *other*
processes kept busy; a ``Quiet`` (one per run, passed to whatever times) waits, within a total budget, for a quiet
machine and counts the rounds it had to redo or had to keep disturbed.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import platform
import subprocess
import time
from pathlib import Path

import torch

from selective_rope.bench import cpu_model_name, load_average

BUSY_THRESHOLD = 0.5  # cores kept busy by other processes above which a round counts as disturbed

# Source files every family's numbers depend on (the benchmarks add their family's kernel / modeling files).
SHARED_SOURCES = [
    "kernels/rotary_torch.py",
    "kernels/rotary_cpu.py",
    "kernels/rotary_cpu_entry.py",
    "kernels/conv_torch.py",
    "modeling/rotary.py",
    "modeling/layers.py",
    "modeling/layout.py",
    "modeling/cache.py",
    "modeling/base.py",
    "configuration/position_embedding.py",
    "benchmarks/harness/machine.py",
    "benchmarks/harness/timing.py",
    "benchmarks/harness/measure.py",
    "benchmarks/harness/runner.py",
]


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def device_info(threads: int) -> dict:
    try:
        import transformers

        transformers_version = transformers.__version__
    except ImportError:  # pragma: no cover - a dependency of the package
        transformers_version = None
    return {
        "processor": platform.processor(),
        "cpu_model": cpu_model_name(),
        "machine": platform.machine(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch_version": torch.__version__,
        "transformers_version": transformers_version,
        "torch_num_threads": torch.get_num_threads(),
        "torch_num_threads_requested": threads,
        "torch_num_interop_threads": torch.get_num_interop_threads(),
        "cpu_count": os.cpu_count(),
        "cpu_count_usable": usable_cores(),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "load_average_start": load_average(),
        "cpu_rotary_call": cpu_rotary_call(),
    }


def cpu_rotary_call() -> str:
    """How the rotary module's CPU inference calls run here: ``"entry"`` (the compiled kernel through its CPython
    entry), ``"ctypes"`` (the compiled kernel through ctypes) or ``"torch"`` (no compiled kernel)."""
    from selective_rope.kernels import rotary_cpu, rotary_cpu_entry

    if not rotary_cpu.available():
        return "torch"
    return "entry" if rotary_cpu_entry.load_entry() is not None else "ctypes"


def source_provenance(root: Path, files: list[str]) -> dict:
    """git commit, and hashes of the source files the numbers depend on (they may hold uncommitted edits).

    ``files`` are paths relative to the repository root ``root``; the shared ones (``SHARED_SOURCES``) are added.
    """
    files = list(dict.fromkeys([*files, *SHARED_SOURCES]))
    info: dict = {"files_sha256_12": {}}
    for name in files:
        path = root / name
        if path.exists():
            info["files_sha256_12"][name] = hashlib.sha256(path.read_bytes()).hexdigest()[:12]
    try:
        def git(*cmd: str) -> str:
            return subprocess.run(["git", *cmd], cwd=root, capture_output=True, text=True,
                                  timeout=10, check=False).stdout.rstrip("\n")

        info["git_commit"] = git("rev-parse", "HEAD").strip()
        # "?? path": not yet committed at all; " M path": modified
        info["uncommitted_changes"] = [line[3:] for line in git("status", "--porcelain", "--", *files).splitlines()]
    except (OSError, subprocess.SubprocessError):
        pass
    return info


class LoadProbe:
    """CPU time that *other* processes used since the probe started: ``/proc/stat`` busy time minus our own.

    "Our own" is this process and its waited-for children (``os.times``), so a benchmark that runs its measurement
    in a child process counts the child once it has been waited for.
    """

    def __init__(self):
        self.start = self._sample()

    @staticmethod
    def _sample() -> tuple[float, float | None, float]:
        busy = None
        try:
            with open("/proc/stat") as f:
                fields = [int(x) for x in f.readline().split()[1:9]]
            busy = (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # minus idle and iowait
        except (OSError, ValueError, IndexError):
            pass
        own = os.times()
        return time.perf_counter(), busy, own.user + own.system + own.children_user + own.children_system

    def others_cores(self) -> float | None:
        """Average number of cores other processes kept busy (clock-tick resolution: coarse under ~50 ms)."""
        wall0, busy0, own0 = self.start
        wall1, busy1, own1 = self._sample()
        if busy0 is None or busy1 is None or wall1 - wall0 <= 0:
            return None
        return max(0.0, (busy1 - busy0) - (own1 - own0)) / (wall1 - wall0)


class Quiet:
    """Waits for a quiet machine (within a total budget) and counts what it had to wait for or redo."""

    def __init__(self, max_wait_s: float, max_redo: int):
        self.max_wait_s, self.max_redo = max_wait_s, max_redo
        self.waited_s = 0.0
        self.redone_rounds = 0
        self.disturbed_rounds_kept = 0
        self.gave_up_waiting = 0  # waits that ended because the budget ran out, not because the machine was quiet

    def wait(self, window_s: float = 0.25, quiet_windows: int = 2) -> None:
        """Return once ``quiet_windows`` consecutive windows saw other processes below the threshold."""
        quiet = 0
        while quiet < quiet_windows and self.waited_s < self.max_wait_s:
            probe = LoadProbe()
            time.sleep(window_s)
            self.waited_s += window_s
            busy = probe.others_cores()
            quiet = quiet + 1 if busy is None or busy < BUSY_THRESHOLD else 0
        if quiet < quiet_windows:
            self.gave_up_waiting += 1

    def remaining_s(self) -> float:
        return max(0.0, self.max_wait_s - self.waited_s)

    def absorb(self, summary: dict) -> None:
        """Add the counts of a child process's ``Quiet`` (see ``summary``)."""
        self.waited_s += summary.get("waited_s", 0.0)
        self.redone_rounds += summary.get("redone_rounds", 0)
        self.disturbed_rounds_kept += summary.get("disturbed_rounds_kept", 0)
        self.gave_up_waiting += summary.get("gave_up_waiting", 0)

    def summary(self) -> dict:
        return {"waited_s": round(self.waited_s, 2), "redone_rounds": self.redone_rounds,
                "disturbed_rounds_kept": self.disturbed_rounds_kept, "gave_up_waiting": self.gave_up_waiting,
                "max_wait_s": self.max_wait_s, "max_redo_per_measurement": self.max_redo}
