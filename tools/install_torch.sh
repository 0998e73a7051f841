#!/bin/sh
# Install PyTorch into the given interpreter's environment, choosing the CPU build where no GPU is present.
# Usage: sh tools/install_torch.sh PYTHON
set -e
py="$1"
install() { "$py" "$(dirname "$0")/install.py" "$@"; }  # uv where it can be had, else pip (tools/install.py)
if "$py" -c "import torch" 2>/dev/null; then exit 0; fi
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
    install "torch>=2.11,<2.14"
    exit
fi
# A local CPU wheel (pip's find-links) is taken as is; otherwise ask PyTorch's CPU index. The probe resolves without
# installing or copying anything (a download probe left a 183 MB wheel in the temp folder).
if "$py" -m pip install --dry-run --quiet --no-deps --no-index "torch==2.13.0" >/dev/null 2>&1; then
    install "torch==2.13.0"
    exit
fi
install "torch>=2.11,<2.14" --index-url https://download.pytorch.org/whl/cpu --extra-index-url https://pypi.org/simple
