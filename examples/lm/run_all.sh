#!/usr/bin/env bash
# Every run behind docs/lm.md: split the standard library by file, train the BPE tokenizer, then GLA / Gated DeltaNet /
# FoX with NoPE / RoPE / Selective RoPE (gate; gate and bias) over 3 seeds, one process at a time, one thread each
# (36 runs of about 1.5-2 minutes on a busy 2-core CPU), then the table and the plot.
# Usage: PYTHON=.venv/bin/python bash examples/lm/run_all.sh [prepare|train|gate_bias|summary]...
# A run already in benchmarks/results/lm.jsonl is skipped (--skip-done; delete its line to run it again).
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python}
LM="$PYTHON $PWD/examples/lm/train_lm.py"
# The budget every model gets: 300 steps x 8 windows x 128 tokens (307k tokens); evaluation on 16k held-out tokens.
BUDGET="--hidden 64 --layers 2 --heads 2 --length 128 --batch 8 --steps 300 --lr 3e-3 --eval-windows 32"
sections=("$@")
[ ${#sections[@]} -eq 0 ] && sections=(prepare train gate_bias summary)

for section in "${sections[@]}"; do
  case "$section" in
    prepare)
      [ -e examples/lm/.cache/tokens.pt ] || $LM prepare ;;
    train|gate_bias)  # train: NoPE / RoPE / Selective RoPE (gate); gate_bias: Selective RoPE (gate + bias)
      if [ "$section" = train ]; then variants="nope rope selective"; else variants="selective_gate_bias"; fi
      for seed in 0 1 2; do  # seed-major, so an interrupted sweep still holds every model at the first seeds
        for family in gla gated_deltanet fox; do
          for variant in $variants; do
            # shellcheck disable=SC2086  # BUDGET is a list of flags
            $LM train --family "$family" --variant "$variant" --seed "$seed" $BUDGET --skip-done
          done
        done
      done ;;
    summary)
      $PYTHON examples/lm/summarize_lm.py ;;
    *) echo "unknown section $section" >&2; exit 2 ;;
  esac
done
