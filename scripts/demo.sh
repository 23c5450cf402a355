#!/usr/bin/env bash
# Install the package (keeping an installed torch; see install_torch.sh), then run the main job: train a tiny
# SelectiveRopeGLA (600 steps, at most 10 minutes), save it, reload it through AutoModelForCausalLM, generate and say
# whether it learned (exit status 1 when not). Arguments go to
# `selective-rope demo` (e.g. --family fox, --max-steps 800).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/install_torch.sh
python -m pip install --quiet -e .
selective-rope demo "$@"
