#!/usr/bin/env bash
# Install everything the tests need (keeping an installed torch; see install_torch.sh), then run them. Arguments go
# to pytest (e.g. -x, -m slow).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/install_torch.sh
python -m pip install --quiet -e ".[test]"
python -m pytest tests "$@"
