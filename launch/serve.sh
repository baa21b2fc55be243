#!/usr/bin/env bash
# Serve a registered encoder over HTTP with MLflow's scoring server, from this project's
# venv (its uvicorn, its code), without activating the venv:
#   bash launch/serve.sh runs/cluttered-xclr-demo/mlflow.db models:/cluttered-encoder@champion
#   curl -s 127.0.0.1:5001/invocations -H 'Content-Type: application/json' \
#        -d "{\"dataframe_records\": [{\"image\": \"$(base64 -w0 photo.jpg)\"}]}"
#   # -> {"predictions": [[...]]}: L2-normalised embeddings (docs/training.md, "serve")
# Arguments: the run's SQLite store (or an http:// tracking URI), the model URI, the port
# (default 5001). Binds 127.0.0.1 unless SERVE_HOST is set.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
store="$1"; model="$2"; port="${3:-5001}"
case "$store" in
    http://*|https://*) uri="$store" ;;
    *) uri="sqlite:///$(realpath "$store")" ;;
esac
export PATH="$repo/.venv/bin:$PATH" MLFLOW_TRACKING_URI="$uri" MLFLOW_REGISTRY_URI="$uri"
exec mlflow models serve -m "$model" --env-manager local --host "${SERVE_HOST:-127.0.0.1}" \
    --port "$port"
