"""Every Triton kernel compiles for a Hopper GPU (sm_90a), checked without one: ``benchmarks/triton_resources.py``
records the launches our wrappers make (prefill forward and backward, dense and packed, with a float64, float32 or
no initial phase; the decode step and its phase inputs) and compiles each with Triton's own compiler and ptxas.

The interpreter, which runs the kernels in the rest of the CPU tests, does not apply Triton's type rules: a float32
carry in the float64 scan passed every CPU test and failed to compile on an H200 (27 Nov 2026). This test fails on
that bug (checked by reverting its fix)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton", reason="triton is not installed")

# Only torch, triton and our kernels: scripts/test_minimum_versions.sh skips it (tests/cli/test_floor_independent.py).
pytestmark = pytest.mark.floor_independent

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "triton_resources.py"
KERNELS = {"_chunk_totals_kernel", "_selective_rotary_fwd_kernel", "_selective_rotary_bwd_kernel", "_suffix_sum_kernel",
           "_selective_rotary_decode_kernel", "_selective_rotary_decode_from_input_kernel", "_phase_increment_kernel",
           "_gate_kernel", "_phase_increment_bwd_kernel"}


def test_every_kernel_compiles_for_hopper(tmp_path):
    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    if not any((bin_dir / name).exists() for name in ("ptxas-blackwell", "ptxas")):
        pytest.skip("this triton carries no ptxas (no NVIDIA backend)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compiled, not interpreted
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    report = tmp_path / "resources.json"
    result = subprocess.run([sys.executable, str(SCRIPT), "--json", str(report)], env=env, cwd=tmp_path,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    rows = json.loads(report.read_text())
    assert {row["kernel"] for row in rows} == KERNELS
    for row in rows:
        assert "error" not in row and 0 < row["registers"] <= 255, row
    # compiled as a GPU launch specialises them: the unit strides are constants (else the compiler cannot tell the
    # contiguous dim, and reports a kernel with another layout and twice the registers of the one that runs)
    forward = [row for row in rows if row["kernel"] == "_selective_rotary_fwd_kernel"]
    assert forward and all({"sq_d", "sk_d", "soq_d", "sok_d", "si_r"} <= set(row["specialised_to_1"])
                           for row in forward), forward
