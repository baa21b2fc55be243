#!/usr/bin/env bash
# Serve a registered encoder over HTTP (MLflow's scoring app behind our request guard,
# serving/server.py) from this project's venv, without activating the venv:
#   bash launch/serve.sh runs/cluttered-xclr-demo/mlflow.db models:/cluttered-encoder@champion
#   curl -s 127.0.0.1:5001/invocations -H 'Content-Type: application/json' \
#        -d "{\"dataframe_records\": [{\"image\": \"$(base64 -w0 photo.jpg)\"}]}"
#   # -> {"predictions": [[...]]}: L2-normalised embeddings (docs/reliability.md, "The server")
# Arguments: the run's SQLite store (or an http:// tracking URI), the model URI, the port
# (default 5001), then any option of `python -m serving.server --help`, e.g.
# `--path-root /data/images` to accept path rows under that directory (off by default).
# Every file of the version is checked against its registered digests before it runs.
# Binds 127.0.0.1 unless SERVE_HOST is set.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
store="$1"; model="$2"; port="${3:-5001}"
shift $(( $# < 3 ? $# : 3 ))
case "$store" in
    http://*|https://*) uri="$store" ;;
    *) uri="sqlite:///$(realpath "$store")" ;;
esac
# glibc: few arenas, so the heap that large decodes free goes back to the system
export MALLOC_ARENA_MAX="${MALLOC_ARENA_MAX:-2}"
exec "$repo/.venv/bin/python" -m serving.server --tracking-uri "$uri" --model "$model" \
    --host "${SERVE_HOST:-127.0.0.1}" --port "$port" "$@"
