#!/usr/bin/env bash
# Install the package (CPU build of torch first), then run the main job: train a tiny SelectiveRopeGLA for a
# minute, save it, reload it through AutoModelForCausalLM and generate.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet "torch==2.13.0"
python -m pip install --quiet -e .
selective-rope demo "$@"
