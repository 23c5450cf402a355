# Sourced by demo.sh and test.sh: keep the torch that is installed (a CPU or a CUDA build); install one only if
# there is none. `pip install torch==2.13.0` takes the wheel pip's index serves: on Linux, PyPI serves the CUDA build
# (with the nvidia-* packages, several GB); PyTorch's CPU index serves the CPU build. To choose, install torch first:
#     pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu    # CPU build
#     pip install torch==2.13.0                                                      # PyPI's default (CUDA on Linux)
if python -c "import torch" 2>/dev/null; then
    echo "using the installed torch $(python -c 'import torch; print(torch.__version__)')"
else
    echo "no torch installed: pip install torch==2.13.0 (the build pip's index serves; on Linux PyPI's is the CUDA" \
         "build; for the CPU build install it first from https://download.pytorch.org/whl/cpu, see README)"
    python -m pip install --quiet "torch==2.13.0"
fi
