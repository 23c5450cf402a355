#!/usr/bin/env bash
# Install the package (keeping an installed torch; see install_torch.sh), then run the main job: train a tiny
# SelectiveRopeGLA for a minute, save it, reload it through AutoModelForCausalLM and generate. Arguments go to
# `selective-rope demo` (e.g. --seconds 20, --family fox).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/install_torch.sh
python -m pip install --quiet -e .
selective-rope demo "$@"
