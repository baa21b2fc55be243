#!/usr/bin/env bash
# The torch a cluster has: build .venv-torch<VERSION> with that torch release (and the
# torchvision made for it), every other package at its launch/constraints.txt pin, and run
# the core tests there: objectives, the step and its host reads, engines, the gathering
# boundary and checkpoints.
#   bash launch/compat.sh 2.11          the lowest torch pyproject.toml declares
# PyPI's Linux torch wheel is the CUDA build, which runs on CPU; TORCH_INDEX=URL takes
# torch and torchvision from another index (https://download.pytorch.org/whl/cpu: the CPU
# build) where that one is reachable. Re-running reuses the venv.
set -euo pipefail
cd "$(dirname "$0")/.."
version="${1:?usage: bash launch/compat.sh TORCH_VERSION (e.g. 2.11)}"
python="${PYTHON:-python3.11}"
command -v "$python" >/dev/null || python=python3
venv=".venv-torch$version"
log="$venv.log"
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
# the pins that come with torch itself (its CUDA libraries, triton, torchvision) are left
# to pip; every other package keeps its pin
constraints="$venv/constraints.txt"
grep -v -i -E '^(torch|torchvision|torchaudio|triton)==|^nvidia-(cublas|cuda-|cudnn|cufft|cufile|curand|cusolver|cusparse|nccl|nvjitlink|nvshmem|nvtx)|^cuda-(bindings|pathfinder|toolkit)==' \
    launch/constraints.txt > "$constraints"
pip() {
    if ! "$venv/bin/python" -m pip --disable-pip-version-check install --quiet "$@" >>"$log" 2>&1; then
        tail -n 30 "$log" >&2
        echo "compat: pip install $* failed; full output in $log" >&2
        exit 1
    fi
}
: > "$log"
pip --constraint "$constraints" --upgrade pip setuptools wheel
index=()
[ -n "${TORCH_INDEX:-}" ] && index=(--index-url "$TORCH_INDEX")
pip "${index[@]}" "torch==$version.*" torchvision
pip --constraint "$constraints" --no-build-isolation --editable ".[dev]"
"$venv/bin/python" -c "import torch; print('compat: torch', torch.__version__)"
start=$SECONDS
"$venv/bin/python" -m pytest -q -p no:cacheprovider \
    tests/pretrain/objectives tests/pretrain/distributed \
    tests/pretrain/loop/test_host_reads.py tests/pretrain/loop/test_cuda_dry_run.py \
    tests/pretrain/loop/test_device_metrics.py tests/pretrain/loop/test_chunked.py \
    tests/pretrain/distributed/test_engine.py tests/pretrain/run/test_checkpoint.py
echo "compat: torch $version passed the core tests in $((SECONDS - start)) s"
