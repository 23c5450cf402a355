#!/usr/bin/env bash
# Issue 17's checks on a CUDA machine, in one call sized for a 15-minute lease (about 9.5 minutes of work):
#   1. correctness, three pytest runs side by side (their timing does not matter): our Triton rotary kernels' tests
#      on CUDA, the CUDA tests that run flash-linear-attention's kernels (-m cuda), and the rest of the default suite
#      with the GPU visible;
#   2. benchmarks/bench_rotary_gpu.py (eager, torch.compile, Triton; every shape), alone on the machine, then
#      benchmarks/profile_rotary_gpu.py (host against device time of one call, host time per Triton launch) and
#      benchmarks/profile_rotary_module_gpu.py (a FoX layer's module in training: phase path against rotary op) and
#      benchmarks/sweep_rotary_gpu.py (the prefill kernels' tiles and warps);
#   3. 370M-class models of each family (benchmarks/bench_models_gpu.py), alone, with the time that is left (120 s,
#      MODELS_LIMIT), in MODEL_FAMILIES' order: FoX first (about two minutes: fla's attention kernel does not
#      autotune), then GLA and Gated DeltaNet, whose training kernels fla autotunes on a bare machine (run 5: GLA's
#      dense step 250 s, its packed step more than 390 s). MODELS_EXTRA adds options (e.g. --no-packed); the JSON is
#      named after the families, so two model runs in one $OUT keep both.
#   4. (issue 45, only when SECTIONS names "graphed") the 370M FoX's decoding step, eager with the dynamic cache against
#      torch.compile(mode="reduce-overhead") with the static cache (CUDA graphs), NoPE and Selective RoPE, interleaved,
#      3 repeats (benchmarks/bench_graphed_decode_gpu.py; GRAPHED_LIMIT seconds, default 420: compiling the 24-layer
#      step with inductor takes minutes).
# Every section has its own time limit, so one that hangs or runs long cannot take the others with it, and a test
# failure is printed when it happens (pytest prints failures at the end, which a time limit cuts off). On a bare
# machine fla's kernels autotune on their first calls: on an H200 (27 Nov 2026) the first GLA training step did not
# finish within 230 s, nor one Gated DeltaNet test within 140 s (runs 1-5), so section 3 may end at its limit. Since
# run 5 the tests time only 4 configurations per kernel (tests/autotuning.py); that has not yet run on a GPU.
# Logs and JSON go to $OUT.
#
# Usage, from the repository root, with selective_rope, triton and flash-linear-attention importable:
#   OUT=/tmp/gpu-check [AUTOTUNE_ARCHIVE=autotune.tgz from an earlier run, or empty for none] \
#       [SECTIONS="tests models"] [MODELS_LIMIT=seconds] [GRAPHED_LIMIT=seconds] [MODEL_FAMILIES="gla fox"] [MODELS_EXTRA=--no-packed] \
#       bash scripts/gpu_check.sh
# SECTIONS picks what runs, in the order below (default: all of "tests bench profile module sweep models"); e.g.
# SECTIONS="tests models" MODELS_LIMIT=420 leaves fla's autotuning of GLA and Gated DeltaNet the time it needs (their
# training kernels try ~300 configurations, each compiled, in the first steps).
# On a machine without a package index (as the lent ones are), bring wheels: here, `pip wheel --no-deps -w .whl .`
# and `pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 -d .whl
# fla-core==0.6.0 flash-linear-attention==0.6.0`; there, `pip install --no-index --no-deps --target /tmp/site
# .whl/*.whl && export PYTHONPATH=/tmp/site` before this script.
set -u
REPO=$(pwd)
OUT=${OUT:-$REPO/benchmarks/results/gpu-check}
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# Everything printed also goes to $OUT/log.txt; beside it only the pytest logs, the JSON results and the autotuning
# archive: at most 8 files, as many as a lent machine sends back.
exec > >(tee -a "$OUT/log.txt") 2>&1

# fla's autotuning results (Triton writes them under its cache dir as *.autotune.json) from an earlier run: with
# them, fla's kernels compile only their chosen configuration instead of benchmarking every one. On an H200 the
# default is the archive of the last run on one (same image: torch 2.11, triton 3.6, fla 0.6.0).
TRITON_CACHE=${TRITON_CACHE_DIR:-$HOME/.triton/cache}
GPU_NAME=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)
if [ -z "${AUTOTUNE_ARCHIVE+set}" ] && [ "$GPU_NAME" = "NVIDIA H200" ]; then
    AUTOTUNE_ARCHIVE=$REPO/benchmarks/results/gpu/2026-11-27-h200/run5-f27cc13/fla_autotune_h200.tgz
fi
if [ -n "${AUTOTUNE_ARCHIVE:-}" ] && [ -f "$AUTOTUNE_ARCHIVE" ]; then
    mkdir -p "$TRITON_CACHE" && tar xzf "$AUTOTUNE_ARCHIVE" -C "$TRITON_CACHE" \
        && echo "autotuning results from $AUTOTUNE_ARCHIVE: $(tar tzf "$AUTOTUNE_ARCHIVE" | grep -c autotune) files"
fi

PLUGINS=$(mktemp -d) || exit 1
trap 'rm -rf -- "$PLUGINS"' EXIT  # the one folder this script made outside $OUT
printf '%s\n' \
    'def pytest_runtest_logreport(report):' \
    '    if report.failed:' \
    '        print(f"\nFAILED {report.nodeid} ({report.when}):\n{report.longreprtext[-4000:]}\n", flush=True)' \
    > "$PLUGINS/report_failures_at_once.py"
export PYTHONPATH="$PLUGINS${PYTHONPATH:+:$PYTHONPATH}"

step() { echo "=== $(date -u +%H:%M:%S) $*"; }
wanted() { case " ${SECTIONS:-tests bench profile module sweep models} " in *" $1 "*) return 0 ;; esac; return 1; }
pytest_in_tmp() {  # from /tmp: inside the checkout, its source tree would shadow the installed package
    local limit=$1 log=$2
    shift 2
    (cd /tmp && timeout "$limit" "$PYTHON" -m pytest -q -p no:cacheprovider -p report_failures_at_once -rfE "$@" \
        > "$log" 2>&1; echo "exit status $?" >> "$log")
}

step "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw \
    --format=csv
(cd /tmp && "$PYTHON" "$REPO/scripts/gpu_machine.py")

if wanted tests; then
step "correctness: our Triton rotary kernels, fla-backed tests (-m cuda) and the rest of the suite, side by side"
ROTARY_TESTS="$REPO/tests/kernels/test_rotary_triton.py"
pytest_in_tmp 120 "$OUT/pytest_rotary.txt" -n 6 "$ROTARY_TESTS" "$REPO/tests/kernels/test_backend_parity.py" \
    -k "test_rotary_triton or rotary_triton or rotary_op or rotary_decode" &
rotary_tests=$!
pytest_in_tmp 120 "$OUT/pytest_cuda.txt" -m cuda "$REPO/tests" &
cuda_tests=$!
pytest_in_tmp 120 "$OUT/pytest_suite.txt" -m "not slow and not cuda" -n 8 --timeout 100 --ignore "$ROTARY_TESTS" \
    "$REPO/tests" &
suite=$!
wait "$rotary_tests" "$cuda_tests" "$suite"  # (a bare wait would also wait for the log's tee, which never ends first)
for log in "$OUT/pytest_rotary.txt" "$OUT/pytest_cuda.txt" "$OUT/pytest_suite.txt"; do
    echo "--- $(basename "$log")"
    grep -h "^FAILED\|exit status\| passed\| failed" "$log" | tail -n 40
done
fi

if wanted bench; then
step "Triton rotary kernels on CUDA: benchmark (eager, torch.compile, Triton)"
timeout 110 "$PYTHON" benchmarks/bench_rotary_gpu.py --repeats 20 --output "$OUT/rotary_gpu.json"
fi

if wanted profile; then
step "Triton rotary kernels on CUDA: host against device time per call, and torch.profiler's tables"
for length in 2048 32768; do
    timeout 30 "$PYTHON" benchmarks/profile_rotary_gpu.py --seq-len $length
done
fi

if wanted module; then
step "one 370M FoX layer's Selective RoPE module in training: the float64 phase path against the rotary op"
timeout 60 "$PYTHON" benchmarks/profile_rotary_module_gpu.py --family fox
fi

if wanted sweep; then
step "prefill kernels' tiles and warps"
timeout 90 "$PYTHON" benchmarks/sweep_rotary_gpu.py
fi

if wanted models; then
step "370M-class models: training (dense, packed) and decoding"
FAMILIES=${MODEL_FAMILIES:-fox gla gated_deltanet}
# shellcheck disable=SC2086  # FAMILIES and MODELS_EXTRA are lists
timeout "${MODELS_LIMIT:-120}" "$PYTHON" benchmarks/bench_models_gpu.py --families $FAMILIES \
    --backends auto --batch-size 4 --seq-len 4096 --context 4096 --decode-batches 1 --train-steps 10 \
    --decode-steps 50 ${MODELS_EXTRA:-} --output "$OUT/models_${FAMILIES// /_}.json"
fi

if wanted graphed; then  # (issue 45; not in the default SECTIONS: ask for it, e.g. SECTIONS=graphed)
step "370M FoX decoding at context 4096, batch 1: eager (dynamic cache) against CUDA-graphed (static cache)"
timeout "${GRAPHED_LIMIT:-420}" "$PYTHON" benchmarks/bench_graphed_decode_gpu.py --context 4096 --batch 1 \
    --steps 50 --repeats 3 --output "$OUT/graphed_decode_gpu.json"
fi

step "fla's autotuning results so far, for the next run (AUTOTUNE_ARCHIVE=...)"
(cd "$TRITON_CACHE" 2>/dev/null && find . -name '*.autotune.json' | tar czf "$OUT/autotune.tgz" -T - \
    && echo "$(tar tzf "$OUT/autotune.tgz" | wc -l) files, $(du -h "$OUT/autotune.tgz" | cut -f1)")

step "done"
