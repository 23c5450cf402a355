"""Time of one demo training step (``selective_rope.demo``: 2-layer GLA, hidden 64, batch 32 x 25 tokens) by torch
thread count and OpenMP wait policy, on a quiet machine and next to busy processes this script starts itself.

Why the demo trains on one thread: with as many torch threads as cores, every multi-threaded op ends in a barrier
that waits for all its threads; when other processes keep the cores busy, one of them is descheduled and the op
waits a scheduler time slice for it, and libgomp's default policy spins first, taking CPU from the thread it waits
for. The demo's ops are too small to gain from a second thread, so one thread loses nothing on a quiet machine.

    python benchmarks/demo_threads_cpu.py                  # -> benchmarks/results/demo_threads_cpu.json
    python benchmarks/demo_threads_cpu.py --busy 0 2 4 --steps 3

Each configuration runs in a fresh process (OMP_WAIT_POLICY is read when libgomp loads, at ``import torch``).
The busy processes are Python loops started and ended (by their process ids) by this script.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from harness.machine import device_info, load_average, source_provenance
from harness.report import log, write_results

ROOT = Path(__file__).resolve().parents[1]
STEP = """
import sys, time, torch
from transformers import AutoModelForCausalLM
from selective_rope.demo import demo_config, progressions
torch.set_num_threads(int(sys.argv[1]))
torch.manual_seed(0)
generator = torch.Generator().manual_seed(0)
model = AutoModelForCausalLM.from_config(demo_config()).train()
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
def step():
    ids = progressions(32, 24, generator)
    loss = model(ids, labels=ids).loss
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
step(); step()
times = []
for _ in range(int(sys.argv[2])):
    start = time.perf_counter(); step(); times.append(time.perf_counter() - start)
print(sorted(times)[len(times) // 2])
"""


def step_seconds(threads: int, policy: str, steps: int) -> float:
    env = {**os.environ, "OMP_WAIT_POLICY": policy}
    out = subprocess.run([sys.executable, "-c", STEP, str(threads), str(steps)], env=env, capture_output=True,
                         text=True, check=True, timeout=3600)
    return float(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--busy", type=int, nargs="+", default=[0, 4], help="busy processes to run beside (0 4)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per configuration (median; default 5)")
    parser.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results" / "demo_threads_cpu.json")
    args = parser.parse_args(argv)
    if min(args.busy) < 0 or args.steps < 1:
        parser.error("--busy must be >= 0 and --steps >= 1")
    cores = len(os.sched_getaffinity(0))
    device = device_info(cores)  # the machine (and its date and load) when the run starts
    rows = []
    for busy in args.busy:
        loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
        try:
            time.sleep(1.0 if busy else 0.0)
            for threads in sorted({1, cores}):
                for policy in ("ACTIVE", "PASSIVE"):
                    load = load_average()
                    seconds = step_seconds(threads, policy, args.steps)
                    rows.append({"busy_processes": busy, "threads": threads, "omp_wait_policy": policy,
                                 "median_step_ms": round(seconds * 1e3, 1), "load_average_before": load})
                    log(f"busy {busy}, threads {threads}, OMP_WAIT_POLICY={policy}: {seconds * 1e3:.1f} ms/step "
                        f"(load average before {load})")
        finally:
            for loop in loops:
                loop.kill()
                loop.wait()
    results = {"benchmark": "demo_threads_cpu", "command": " ".join(["python", *sys.argv]),
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cores": cores,
               "device": device, "source": source_provenance(ROOT, ["selective_rope/demo.py"]),
               "steps": args.steps, "rows": rows}
    write_results(args.output, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
