#!/usr/bin/env bash
# Issue 17's checks on a CUDA machine, in one call sized for a short lease (~9.5 minutes):
#   1. the CUDA tests (-m cuda) and, beside them, the rest of the default suite with the GPU visible;
#   2. the Selective RoPE op (benchmarks/bench_rotary_gpu.py): every shape without torch.compile, then with it at
#      the lengths where the targets are set;
#   3. 370M-class models of each family (benchmarks/bench_models_gpu.py): training (dense and packed), decoding.
# Every section has its own time limit, so one that hangs or runs long cannot take the others with it. Logs and
# JSON go to $OUT (default benchmarks/results/gpu-check/); the last lines printed are a summary.
#
# Usage, from the repository root, with selective_rope, triton and flash-linear-attention importable:
#   OUT=/tmp/gpu-check bash scripts/gpu_check.sh
set -u
REPO=$(pwd)
OUT=${OUT:-$REPO/benchmarks/results/gpu-check}
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

step() { echo "=== $(date -u +%H:%M:%S) $*"; }

step "machine"
{
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw \
        --format=csv 2>&1
    git -C "$REPO" rev-parse HEAD 2>/dev/null || echo "no git metadata here"
    $PYTHON - <<'EOF'
import torch, triton, transformers, fla, selective_rope
print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__,
      "transformers", transformers.__version__, "fla", fla.__version__, "selective_rope", selective_rope.__file__)
print("device", torch.cuda.get_device_name(0), torch.cuda.get_device_properties(0))
# The measured ceiling for the op's bandwidth fractions: a large device-to-device copy (bytes read + written).
x = torch.empty(2**31, dtype=torch.uint8, device="cuda"); y = torch.empty_like(x)
for _ in range(3): y.copy_(x)
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
times = []
for _ in range(10):
    start.record(); y.copy_(x); end.record(); end.synchronize(); times.append(start.elapsed_time(end) / 1e3)
times.sort()
print(f"copy bandwidth (read + write, 2 GiB, median of 10): {2 * x.numel() / times[5] / 1e9:.0f} GB/s")
EOF
} 2>&1 | tee "$OUT/machine.txt"

step "tests: -m cuda, and the rest of the default suite beside them"
(cd /tmp && timeout 150 $PYTHON -m pytest -q -p no:cacheprovider -m cuda -rfE "$REPO/tests" \
    > "$OUT/pytest_cuda.txt" 2>&1; echo "exit status $?" >> "$OUT/pytest_cuda.txt") &
(cd /tmp && timeout 150 $PYTHON -m pytest -q -p no:cacheprovider -m "not slow and not cuda" -n 12 --timeout 120 \
    -rfE "$REPO/tests" > "$OUT/pytest_suite.txt" 2>&1; echo "exit status $?" >> "$OUT/pytest_suite.txt") &
wait
tail -n 40 "$OUT/pytest_cuda.txt"
tail -n 40 "$OUT/pytest_suite.txt"

step "Selective RoPE op: all shapes, eager and Triton"
timeout 70 $PYTHON benchmarks/bench_rotary_gpu.py --no-compile --repeats 20 --output "$OUT/rotary_gpu.json" 2>&1

step "370M-class models: training (dense, packed) and decoding"
timeout 230 $PYTHON benchmarks/bench_models_gpu.py --backends auto --batch-size 4 --seq-len 4096 --context 4096 \
    --train-steps 10 --decode-steps 50 --output "$OUT/models_gpu.json" 2>&1

step "Selective RoPE op against torch.compile at T = 8k and 32k"
timeout 100 $PYTHON benchmarks/bench_rotary_gpu.py --batches 1 --lengths 8192 32768 --repeats 20 \
    --output "$OUT/rotary_gpu_compile.json" 2>&1

step "done"
