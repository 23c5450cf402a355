#!/usr/bin/env bash
# The GPU checks in one call sized for a 15-minute lease. Sections, in this order (SECTIONS picks them):
#   tests    correctness, two pytest runs side by side: our Triton rotary kernels' tests, and the CUDA parity tests
#            (-m cuda: every family, fp32 and bf16, padding, cached decoding, generate, packing; at most 4
#            failures). fla's kernels run their first configuration there (tests/autotuning.py), so nothing autotunes.
#   suite    (not in the default) the rest of the default suite with the GPU visible.
#   decode   (not in the default) where an eager decoding step's time goes, NoPE against Selective RoPE, 370M GLA and
#            FoX (benchmarks/profile_decode_gpu.py; issue 46: GLA decodes at 2.28x NoPE although its rotary step is
#            one fused launch, as FoX's). DECODE_LIMIT (default 150).
#   host     (not in the default) this host's CPU time around our kernels with their launches stubbed: decoding
#            steps, the op's and one layer's training forward + backward, and their launch and op counts
#            (benchmarks/host_time_cpu.py).
#   models   370M-class models (benchmarks/bench_models_gpu.py), one family at a time, each with its own time limit
#            (MODELS_LIMIT seconds, default 120), in MODEL_FAMILIES' order (default "fox gla gated_deltanet"):
#            NoPE / RoPE / Selective RoPE / NoPE again, training dense and packed, peak memory, eager decoding.
#            fla's kernels run their saved autotuning choice (the archive below) or their first candidate
#            (benchmarks/pinned_autotuning.py): nothing autotunes. MODELS_EXTRA adds options (e.g. --no-packed).
#   graphed  the FoX decoding step eager (dynamic cache) against torch.compile(mode="reduce-overhead") with the static
#            cache (CUDA graphs), NoPE and Selective RoPE interleaved (benchmarks/bench_graphed_decode_gpu.py;
#            GRAPHED_LAYERS, default 24: inductor compiles the whole step, minutes at 24 layers; GRAPHED_LIMIT).
#   bench    the rotary op: eager, torch.compile, Triton (benchmarks/bench_rotary_gpu.py).
#   profile  host against device time of one call (benchmarks/profile_rotary_gpu.py).
#   module   one 370M FoX layer's Selective RoPE module in training: phase path against rotary op; forward only, the
#            phase path's torch ops against kernels/phase_triton.py's one launch.
#   sweep    the prefill kernels' tiles and warps (benchmarks/sweep_rotary_gpu.py).
# Last, always: issue 46's targets read from what this call wrote (benchmarks/gpu_targets.py; training ratio, peak
# memory, packing, the op's bandwidth at T >= 8k), into $OUT/log.txt.
# Issue 46's call, in ~8 minutes: SECTIONS="tests decode host models bench module" MODEL_FAMILIES="fox gla"
# DEADLINE_S=500 (decode and host run right after the tests, before the models).
# Every section has its own time limit, cut to what is left of DEADLINE_S (seconds of work for the whole script, if
# set), so one that hangs cannot take the others with it; a test failure is printed when it happens (pytest prints
# failures at the end, which a time limit cuts off). Logs and JSON go to $OUT (at most 8 files, as many as a lent
# machine sends back).
#
# Usage, from the repository root, with selective_rope, triton and flash-linear-attention importable:
#   OUT=/tmp/gpu-check [AUTOTUNE_ARCHIVE=autotune.tgz from an earlier run, or empty for none] [DEADLINE_S=seconds] \
#       [SECTIONS="tests models"] [MODELS_LIMIT=seconds] [MODEL_FAMILIES="gla fox"] [MODELS_EXTRA=--no-packed] \
#       [GRAPHED_LIMIT=seconds] [GRAPHED_LAYERS=n] [CUDA_TEST_WORKERS=n, default 4] bash scripts/gpu_check.sh
# Default SECTIONS: "tests models graphed bench profile module sweep".
# On a machine without a package index (as the lent ones are), bring wheels: here, from a fresh clone (a checkout's
# stale build/ folder goes into the wheel: on 28 Nov 2026 it shadowed selective_rope/bench.py with an old package),
# `pip wheel --no-deps -w .whl .`
# and `pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 -d .whl
# fla-core==0.6.0 flash-linear-attention==0.6.0`; there, `pip install --no-index --no-deps --target /tmp/site
# .whl/*.whl && export PYTHONPATH=/tmp/site` before this script.
set -u
START=$(date +%s)
REPO=$(pwd)
OUT=${OUT:-$REPO/benchmarks/results/gpu-check}
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# Everything printed also goes to $OUT/log.txt; beside it only the pytest logs, the JSON results and the autotuning
# archive: at most 8 files, as many as a lent machine sends back.
exec > >(tee -a "$OUT/log.txt") 2>&1

# fla's autotuning results (Triton writes them under its cache dir as *.autotune.json) from an earlier run: with
# them, fla's kernels compile only their chosen configuration instead of benchmarking every one. Triton's cache key
# holds the arch ("90" for every H100 and H200), not the card's name, so on any sm_90 card the default is the archive
# of the last call on an H200 (same image: torch 2.11, triton 3.6, fla 0.6.0).
TRITON_CACHE=${TRITON_CACHE_DIR:-$HOME/.triton/cache}
COMPUTE_CAPABILITY=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n 1)
if [ -z "${AUTOTUNE_ARCHIVE+set}" ] && [ "$COMPUTE_CAPABILITY" = "9.0" ]; then
    AUTOTUNE_ARCHIVE=$REPO/benchmarks/results/gpu/2026-11-28-h200/call4-54d029b/fla_autotune_h200.tgz
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
wanted() {
    case " ${SECTIONS:-tests models graphed bench profile module sweep} " in *" $1 "*) ;; *) return 1 ;; esac
    [ "$(limit 20)" -ge 20 ] || { echo "=== $1: skipped, DEADLINE_S=${DEADLINE_S} reached"; return 1; }
}
limit() {  # the section's own limit ($1 seconds), cut to what is left of DEADLINE_S (1 once under 20 s are left)
    if [ -z "${DEADLINE_S:-}" ]; then echo "$1"; return; fi
    local left=$((DEADLINE_S - ($(date +%s) - START)))
    if [ "$left" -lt 20 ]; then echo 1; elif [ "$left" -lt "$1" ]; then echo "$left"; else echo "$1"; fi
}
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
step "correctness: our Triton rotary kernels' tests and the CUDA parity tests (-m cuda), side by side"
TESTS_LIMIT=$(limit 120)
pytest_in_tmp "$TESTS_LIMIT" "$OUT/pytest_rotary.txt" -n 4 "$REPO/tests/kernels/test_rotary_triton.py" \
    "$REPO/tests/kernels/test_autotuning.py" &
rotary_tests=$!
# --maxfail 4, not -x: on 28 Nov 2026 one test's failure under -x left 14 of the 31 unrun. --timeout: one hanging test
# (fla autotuning, a compile) cannot hold the section. -rA: each result by name (pytest_in_tmp's -q hides -v's).
pytest_in_tmp "$TESTS_LIMIT" "$OUT/pytest_cuda.txt" -m cuda --maxfail 4 --timeout 90 -n "${CUDA_TEST_WORKERS:-4}" \
    -rA "$REPO/tests" &
cuda_tests=$!
wait "$rotary_tests" "$cuda_tests"  # (a bare wait would also wait for the log's tee, which never ends first)
for log in "$OUT/pytest_rotary.txt" "$OUT/pytest_cuda.txt"; do
    echo "--- $(basename "$log")"
    grep -h "^FAILED\|exit status\| passed\| failed" "$log" | tail -n 40
done
fi

if wanted suite; then
step "the rest of the default suite with the GPU visible"
pytest_in_tmp "$(limit 150)" "$OUT/pytest_suite.txt" -m "not slow and not cuda" -n 8 --timeout 100 \
    --ignore "$REPO/tests/kernels/test_rotary_triton.py" "$REPO/tests"
grep -h "^FAILED\|exit status\| passed\| failed" "$OUT/pytest_suite.txt" | tail -n 40
fi

if wanted decode; then
step "eager decoding step of the 370M GLA and FoX: NoPE against Selective RoPE, host and device time, profiles"
timeout "$(limit "${DECODE_LIMIT:-150}")" "$PYTHON" benchmarks/profile_decode_gpu.py --families gla fox \
    --variants nope selective_rope --context 4096 --steps 20
fi

if wanted host; then
step "host time around our kernels on this machine's CPU, launches stubbed: counts, then times"
timeout "$(limit 40)" "$PYTHON" benchmarks/host_time_cpu.py --count
timeout "$(limit 60)" "$PYTHON" benchmarks/host_time_cpu.py --rounds 10 --calls 50
fi

if wanted models; then
step "370M-class models: training (dense, packed) and decoding, one family at a time"
for family in ${MODEL_FAMILIES:-fox gla gated_deltanet}; do
    FAMILY_LIMIT=$(limit "${MODELS_LIMIT:-120}")
    [ "$FAMILY_LIMIT" -gt 1 ] || { echo "=== $family: skipped, DEADLINE_S reached"; continue; }
    step "$family ($FAMILY_LIMIT s)"
    # shellcheck disable=SC2086  # MODELS_EXTRA is a list
    timeout "$FAMILY_LIMIT" "$PYTHON" benchmarks/bench_models_gpu.py --families "$family" --backends auto \
        --batch-size 4 --seq-len 4096 --context 4096 --decode-batches 1 --train-steps 6 --decode-steps 30 \
        ${MODELS_EXTRA:-} --output "$OUT/models_$family.json"
done
fi

if wanted graphed; then
step "FoX decoding at context 4096, batch 1: eager (dynamic cache) against CUDA-graphed (static cache)"
timeout "$(limit "${GRAPHED_LIMIT:-420}")" "$PYTHON" benchmarks/bench_graphed_decode_gpu.py --context 4096 --batch 1 \
    --layers "${GRAPHED_LAYERS:-24}" --steps 30 --repeats 3 --output "$OUT/graphed_decode_gpu.json"
fi

if wanted bench; then
step "Triton rotary kernels on CUDA: benchmark (eager, torch.compile, Triton)"
timeout "$(limit 110)" "$PYTHON" benchmarks/bench_rotary_gpu.py --repeats 20 --output "$OUT/rotary_gpu.json"
fi

if wanted profile; then
step "Triton rotary kernels on CUDA: host against device time per call, and torch.profiler's tables"
for length in 2048 32768; do
    timeout "$(limit 30)" "$PYTHON" benchmarks/profile_rotary_gpu.py --seq-len $length
done
fi

if wanted module; then
step "one 370M FoX layer's Selective RoPE module in training: the float64 phase path against the rotary op"
timeout "$(limit 60)" "$PYTHON" benchmarks/profile_rotary_module_gpu.py --family fox
fi

if wanted sweep; then
step "prefill kernels' tiles and warps"
timeout "$(limit 90)" "$PYTHON" benchmarks/sweep_rotary_gpu.py
fi

step "issue 46's targets in this call's results"
"$PYTHON" benchmarks/gpu_targets.py "$OUT"

step "fla's autotuning results so far, for the next run (AUTOTUNE_ARCHIVE=...)"
(cd "$TRITON_CACHE" 2>/dev/null && find . -name '*.autotune.json' | tar czf "$OUT/autotune.tgz" -T - \
    && echo "$(tar tzf "$OUT/autotune.tgz" | wc -l) files, $(du -h "$OUT/autotune.tgz" | cut -f1)")

step "done"
