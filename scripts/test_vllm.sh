#!/usr/bin/env bash
# The vLLM plugin's tests (tests_vllm/) in the vLLM environment, built or refreshed first (scripts/vllm_env.sh).
# Arguments go to pytest. .ci/run runs it after the main suites.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/vllm_env.sh
# shellcheck disable=SC1091  # the venv's own activation script
source "${SELECTIVE_ROPE_VLLM_VENV:-.venv-vllm}/bin/activate"
python -m pytest tests_vllm "$@"
