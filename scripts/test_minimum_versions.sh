#!/usr/bin/env bash
# The test suite against the lowest versions pyproject.toml allows of the runtime dependencies: each `>=` floor in
# [project] dependencies is pinned with `==` (a pip constraints file) in a virtual environment of its own, made in a
# temporary folder and removed afterwards. torch is the exception: it is installed as scripts/install_torch.sh does
# (2.13.0) and its floor is the lowest version seen working (see pyproject.toml). The test extras (pytest, triton,
# flash-linear-attention) stay at their newest. Then the conformance suite (scripts/conformance.sh) at the floors:
# transformers' common model tests from the floor version's own sdist. Arguments go to pytest. Needs Python >= 3.11
# (tomllib) and the package index. .ci/run runs it after the README's test command and the conformance suite.
set -euo pipefail
cd "$(dirname "$0")/.."
scratch=$(mktemp -d)
trap 'rm -rf -- "$scratch"' EXIT  # the one folder this script made
python scripts/minimum_versions.py "$scratch/minimum.txt"
python -m venv "$scratch/venv"
# shellcheck disable=SC1091  # the venv's own activation script
source "$scratch/venv/bin/activate"
source scripts/install_torch.sh
python -m pip install --quiet -e ".[test]" -c "$scratch/minimum.txt"
# torchao is a test oracle only (quantized loading, tests/integration/test_quantization.py, run by the main suite):
# peft 0.18 (our floor) imports names torchao has since removed and fails every LoRA model while torchao is installed.
python -m pip uninstall --quiet --yes torchao
python -m pip list 2>/dev/null | grep -i -E "^(torch|transformers|accelerate|peft|huggingface.hub|safetensors|tqdm) " || true
# Not the modules marked floor_independent: they import no pinned package, so they would rerun the main run's code at
# its versions (tests/cli/test_floor_independent.py checks the claim). A `-m` among the arguments replaces this one.
python -m pytest tests -m "not slow and not floor_independent" "$@"
bash scripts/conformance.sh "$@"
