#!/usr/bin/env bash
# Every full run behind docs/synthetic.md, one process at a time, one thread each (about 60-75 minutes on a
# 2-core CPU shared with other work).
# Usage: bash examples/synthetic/run_all.sh [parity|mqar|copy|fox|gdn|paper_small|paper_wide|sweep|summary]...
# `sweep` (the parity recipe sweep, 172 runs, about 3 hours one at a time) is not in the default list.
# `paper_small` (the paper's state-tracking Selective RoPE at hidden 64 with its ablations, 35 runs) and `paper_wide`
# (at the paper's width, 9 runs) are not in the default list either (about 1.5 and 1 hours on a busy 2-core CPU).
# Each run stores its result as one line of benchmarks/results/synthetic.jsonl, keyed <task>/<variant><tag>_seed<k>
# (a rerun replaces its line); `summary` rebuilds the tables and plots (needs matplotlib).
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python}  # e.g. PYTHON=.venv/bin/python
TRAIN="$PYTHON $PWD/examples/synthetic/train.py --threads 1"
SEEDS="0 1 2"
sections=("$@")
[ ${#sections[@]} -eq 0 ] && sections=(parity mqar copy fox gdn summary)

for section in "${sections[@]}"; do
  case "$section" in
    parity)  # GLA, 1 layer, train on 40 bits (per-token running parity), test at 20..320 bits; 600 steps x 64
      for seed in $SEEDS; do
        for variant in nope rope selective selective_plain selective_bias selective_gate_bias; do
          $TRAIN --task parity --variant "$variant" --seed "$seed"
        done
      done
      # The library's default phase convolution (size 4) instead of the task's 0. The stored `_conv4` rows (seeds 0-2)
      # were run before the convolution started as the identity; these runs reproduce the `_conv4identity` rows.
      for seed in 0 1 2 3 4; do
        for variant in selective selective_gate_bias; do
          $TRAIN --task parity --variant "$variant" --seed "$seed" --set phase_conv_size=4 --tag _conv4identity
        done
      done
      for seed in 3 4; do  # two more seeds for the two variants that reach the target in some seeds
        for variant in selective selective_gate_bias; do
          $TRAIN --task parity --variant "$variant" --seed "$seed"
        done
      done ;;
    mqar)  # GLA, 2 layers, 8 key-value pairs (keys/values from 32 each), test at 4..24 pairs
      for seed in $SEEDS; do
        for variant in nope rope selective; do
          $TRAIN --task mqar --variant "$variant" --seed "$seed"
        done
      done
      for steps in 100 200 800; do  # budget sweep, seed 0 (the main runs above: 400 steps)
        for variant in nope rope selective; do
          $TRAIN --task mqar --variant "$variant" --seed 0 --steps "$steps" --tag "_steps$steps"
        done
      done
      for seed in $SEEDS; do for variant in nope rope selective; do  # a harder setting: hidden 32, 16 pairs
        $TRAIN --task mqar --variant "$variant" --seed "$seed" --hidden 32 --train-length 16 --steps 600 \
          --eval-lengths 8 16 24 32 --tag _hidden32_pairs16
      done; done ;;
    copy)  # GLA, 2 layers, strings of 2..16 letters (alphabet 26), test at 8..64 letters
      for seed in $SEEDS; do
        for variant in nope rope selective; do
          $TRAIN --task copy --variant "$variant" --seed "$seed"
        done
      done ;;
    fox)  # softmax attention with a forget gate (FoX), 1 layer, on parity: 600 steps (3 seeds), then 2400 steps
      for seed in $SEEDS; do
        for variant in nope rope selective; do
          $TRAIN --task parity --family fox --variant "$variant" --seed "$seed" --tag _fox
        done
      done
      for variant in nope rope; do
        $TRAIN --task parity --family fox --variant "$variant" --seed 0 --steps 2400 --tag _fox_steps2400
      done
      for seed in $SEEDS; do
        $TRAIN --task parity --family fox --variant selective --seed "$seed" --steps 2400 --tag _fox_steps2400
      done ;;
    gdn)  # Gated DeltaNet, 1 layer, on parity (600 steps); NoPE with negative eigenvalues as the known solution
      for seed in $SEEDS; do
        for variant in nope rope; do
          $TRAIN --task parity --family gated_deltanet --variant "$variant" --seed "$seed" --tag _gdn
        done
        $TRAIN --task parity --family gated_deltanet --variant nope --seed "$seed" --tag _gdn_negeig \
          --set allow_neg_eigval=true
      done
      for seed in $SEEDS 3 4; do
        for variant in selective selective_gate_bias; do
          $TRAIN --task parity --family gated_deltanet --variant "$variant" --seed "$seed" --tag _gdn
        done
      done ;;
    paper_small|paper_wide)  # the paper's state-tracking config (docs/synthetic.md, "The paper's setup")
      # Training lengths 4-32 (every batch its own length), OneCycle; a run already in the store is skipped
      # (--skip-done), so an interrupted section resumes where it stopped.
      SMALL="--heads 4 --train-length 32 --min-train-length 4 --steps 1500 --schedule onecycle --lr 3e-3"
      WIDE="--hidden 384 --heads 12 --train-length 32 --min-train-length 4 --steps 500 --schedule onecycle --lr 5e-4"
      EVAL="--eval-lengths 16 32 64 128"
      once() {  # scale variant seed
        local options
        if [ "$1" = small ]; then options=$SMALL; else options=$WIDE; fi
        # shellcheck disable=SC2086
        $TRAIN --task parity --variant "$2" --seed "$3" $options $EVAL --run "parity/paper/$1/${2}_seed$3" --skip-done
      }
      if [ "$section" = paper_small ]; then  # hidden 64, 4 heads: the paper's variant, its ablations, NoPE, RoPE
        for seed in 0 1 2; do
          for variant in nope rope paper paper_theta500k paper_gate paper_nobias paper_noconv; do
            once small "$variant" "$seed"
          done
        done
        for variant in paper nope rope; do for seed in 3 4; do once small "$variant" "$seed"; done; done
        for seed in 3 4; do
          for variant in paper_theta500k paper_gate paper_nobias paper_noconv; do once small "$variant" "$seed"; done
        done
      else  # the paper's width (hidden 384, 12 heads), a third of the small budget in steps
        once wide paper 0; once wide nope 0; once wide rope 0; once wide paper 1; once wide paper 2
        once wide nope 1; once wide rope 1; once wide paper 3; once wide paper 4
      fi ;;
    sweep)  # parity recipe sweep (docs/synthetic.md): one group per recipe, keyed parity/sweep/<variant>_<group>_seed<k>
      F0="--lr-floor 0"; LS="--label-smoothing 0.1"; PI="--set temperature_max=3.141592653589793"
      L128="--train-length 128 --eval-lengths 64 128 256 512"
      recipes=(  # group|seeds|variant|options
        "ls0.1|0 1 2 3 4|selective|$LS"
        "wd0.1|0 1 2 3 4|selective|--weight-decay 0.1"
        "floor0|0 1 2 3 4|selective_gate_bias|$F0"
        "h4|0 1 2 3 4|selective_gate_bias|--heads 4"
        "ls0.1|0 1 2 3 4|selective_gate_bias|$LS"
        "ls0.1_floor0|0 1 2 3 4 5 6 7 8 9|selective_gate_bias|$LS $F0"
        "ls0.1_floor0_cur300|0 1 2 3 4|selective_gate_bias|$LS $F0 --curriculum-steps 300"
        "ls0.1_floor0_cur600_st1200|0 1 2 3 4 5 6 7 8 9|selective_gate_bias|$LS $F0 --curriculum-steps 600 --steps 1200"
        "ls0.1_floor0_pi|0 1 2 3 4|selective_gate_bias|$LS $F0 $PI"
        "ls0.1_floor0_st1000|0 1 2 3 4|selective_gate_bias|$LS $F0 --steps 1000"
        "ls0.2_floor0|0 1 2 3 4|selective_gate_bias|--label-smoothing 0.2 $F0"
        "pi|0 1 2 3 4|selective_gate_bias|$PI"
        "pi_wd0.1|0 1 2 3 4|selective_gate_bias|$PI --weight-decay 0.1"
        "recipe_h4|0 1 2 3 4 5 6 7 8 9|selective_gate_bias|$LS $F0 --curriculum-steps 300 --heads 4"
        "recipe_th100|0 1 2 3 4|selective_gate_bias|$LS $F0 --curriculum-steps 300 --set temperature_theta=100"
        "wd0.1|0 1 2 3 4|selective_gate_bias|--weight-decay 0.1"
        # third session: the paper's training length, batch, bit density, capacity, depth, width, a 10x budget
        "len128|0 1 2 3 4|selective_gate_bias|$L128"
        "len128_cur300|0 1 2 3 4|selective_gate_bias|$L128 --curriculum-steps 300"
        "len128_st1200|0 1 2 3 4|selective_gate_bias|$L128 --steps 1200"
        "b512|0 1|selective_gate_bias|--batch 512"
        "dens|0 1 2 3 4|selective_gate_bias|--bit-density uniform"
        "dens_cur300|0 1 2 3 4|selective_gate_bias|--bit-density uniform --curriculum-steps 300"
        "dens_h4|0 1 2 3 4|selective_gate_bias|--bit-density uniform --heads 4"
        "dens_st1200|0 1 2 3|selective_gate_bias|--bit-density uniform --steps 1200"
        "mixed|0 1 2 3 4|selective_gate_bias|--bit-density mixed"
        "h1|0 1 2 3 4|selective_gate_bias|--heads 1"
        "scalar|0 1 2 3 4|selective_gate_bias|--set phase_proj=scalar"
        "st6000|0 1 2|selective_gate_bias|--steps 6000"
        "dens_st6000|0 1 2|selective_gate_bias|--bit-density uniform --steps 6000"
        "l2|0 1 2 3 4 5 6 7 8 9|selective_gate_bias|--layers 2"
        "l2|0 1 2 3 4|selective|--layers 2"
        "hid128|0 1 2 3 4|selective_gate_bias|--hidden 128"
      )
      for entry in "${recipes[@]}"; do
        IFS="|" read -r group seeds variant options <<< "$entry"
        for seed in $seeds; do
          # shellcheck disable=SC2086  # options is a list of flags
          $TRAIN --task parity --variant "$variant" --seed "$seed" $options \
            --run "parity/sweep/${variant}_${group}_seed${seed}"
        done
      done ;;
    summary)
      $PYTHON examples/synthetic/summarize.py ;;
    *) echo "unknown section $section" >&2; exit 2 ;;
  esac
done
