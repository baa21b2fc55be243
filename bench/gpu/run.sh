#!/usr/bin/env bash
# The GPU kit on a bare, offline GPU node, with the node's own python3 and torch:
#   bash bench/gpu/run.sh OUT_DIR                 # about 9 minutes on one GPU
#   bash bench/gpu/run.sh --dry-run OUT_DIR       # the same code on CPU, tiny sizes
# Installs bench/gpu/wheels/ (bash bench/gpu/fetch_wheels.sh, beforehand, where there is
# an index) into OUT_DIR/site, never over what the node has; no MLflow, no network.
# Writes OUT_DIR/gpu.json, OUT_DIR/gpu.md and OUT_DIR/logs/. Extra arguments go to
# `python -m bench.gpu` (--parts, --budget).
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
python="${PYTHON:-python3}"
args=()
out=""
for arg in "$@"; do
    case "$arg" in
        -*) args+=("$arg") ;;
        *) if [ -z "$out" ]; then out="$arg"; else args+=("$arg"); fi ;;
    esac
done
[ -n "$out" ] || { echo "usage: bash bench/gpu/run.sh [--dry-run] OUT_DIR [--parts ...] [--budget S]" >&2; exit 2; }
mkdir -p "$out"
out="$(cd "$out" && pwd)"
site="$out/site"
for wheel in "$repo"/bench/gpu/wheels/*.whl; do  # one at a time: a wheel built for another
    [ -e "$wheel" ] || continue                   # Python (torchcodec) is skipped, said so
    "$python" -m pip install --quiet --disable-pip-version-check --no-index --no-deps \
        --no-compile --target "$site" "$wheel" 2>/dev/null \
        || echo "run.sh: $(basename "$wheel") does not install on this node: skipped" >&2
done
# the node's packages first: the wheels only fill in what it lacks
export PYTHONPATH="$repo:${PYTHONPATH:+$PYTHONPATH:}$("$python" -c 'import site; print(":".join(site.getsitepackages()))'):$site"
export HF_HUB_OFFLINE=1 MLFLOW_TRACKING_URI="" PYTHONUNBUFFERED=1
cd "$repo"
exec "$python" -m bench.gpu "$out" "${args[@]}"
