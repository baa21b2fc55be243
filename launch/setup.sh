#!/usr/bin/env bash
# Create (or reuse) .venv with pip and install the project into it, editable, at the
# versions pinned in launch/constraints.txt (refresh them with launch/lock.sh).
#   launch/setup.sh            runtime dependencies
#   launch/setup.sh dev        plus test tools
#   launch/setup.sh dev,bench  plus benchmark-only peers (lightly, pytorch-metric-learning)
# Idempotent: re-running reuses the venv and installs only what is missing. Quiet unless an
# install fails; the whole pip output is in .venv/setup.log.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
python="${PYTHON:-python3.11}"
command -v "$python" >/dev/null || python=python3
if [ ! -x .venv/bin/python ]; then
    "$python" -m venv .venv
fi
log=.venv/setup.log
: > "$log"
pip() {
    if ! .venv/bin/python -m pip --disable-pip-version-check install --quiet \
            --constraint launch/constraints.txt "$@" >>"$log" 2>&1; then
        tail -n 40 "$log" >&2
        echo "setup: pip install $* failed; full output in $log" >&2
        exit 1
    fi
}
# pip, not uv/poetry: pip also sees this machine's local wheel cache.
pip --upgrade pip setuptools wheel
# torch first, so DeepSpeed (an sdist that imports torch to build) finds it without an
# isolated build environment that would fetch a second copy of torch.
pip torch torchvision
spec="."
[ -n "$extras" ] && spec=".[$extras]"
pip --no-build-isolation --editable "$spec"
# DeepSpeed compiles its CPU communication op the first time a process group starts on a
# CPU (about 30 s on 2 cores) into .venv/torch_extensions (the engine's own_extension_cache);
# here it is built once, with the install, not in the first run. Where the accelerator is a
# GPU it returns at once.
if ! .venv/bin/python -c 'from pretrain.distributed.deepspeed_engine import own_extension_cache
own_extension_cache()
from deepspeed.comm.torch import build_shm_op; build_shm_op()' >>"$log" 2>&1; then
    echo "setup: DeepSpeed's CPU op did not build (see $log); its first CPU run tries again" >&2
fi
echo "setup: .venv ready ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))"
