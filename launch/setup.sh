#!/usr/bin/env bash
# Create (or reuse) .venv with pip and install the project into it, editable.
#   launch/setup.sh            runtime dependencies
#   launch/setup.sh dev        plus test tools
#   launch/setup.sh dev,bench  plus benchmark-only peers (lightly, pytorch-metric-learning)
# Idempotent: re-running reuses the venv and installs only what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
python="${PYTHON:-python3.11}"
command -v "$python" >/dev/null || python=python3
if [ ! -x .venv/bin/python ]; then
    "$python" -m venv .venv
fi
# pip, not uv/poetry: pip takes torch and torchvision from this machine's local wheel cache.
.venv/bin/python -m pip install --quiet --upgrade "pip>=24" setuptools wheel
# torch first, so DeepSpeed (an sdist that imports torch to build) finds it without an isolated
# build environment that would fetch a second copy of torch.
.venv/bin/python -m pip install --quiet torch torchvision
spec="."
[ -n "$extras" ] && spec=".[$extras]"
.venv/bin/python -m pip install --quiet --no-build-isolation -e "$spec"
echo "setup: .venv ready ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))"
