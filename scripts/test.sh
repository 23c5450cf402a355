#!/usr/bin/env bash
# Install everything the tests need (CPU build of torch first, so pip does not pull CUDA wheels), then run them.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet "torch==2.13.0"
python -m pip install --quiet -e ".[test]"
python -m pytest tests "$@"
