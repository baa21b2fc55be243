#!/usr/bin/env bash
# The main job on the embedded defaults, in the current directory (or DEMO_DIR):
# cluttered digits -> WebDataset shards -> class-template graph (bundled sentence model) ->
# 2-process CPU X-CLR training with DDP over gloo -> encoder registered in the run's SQLite
# MLflow store -> kNN, linear probe and diagnostics of that version beside an untrained
# encoder, promoted to `champion` if it beats the holder. Extra key=value arguments go to
# every stage (CI passes a smaller setting); PYTHON, the interpreter each stage runs in.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
cd "${DEMO_DIR:-$repo}"
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1
python="${PYTHON:-$repo/.venv/bin/python}"  # each stage: python -m <its module>
config="$repo/launch/configs/demo.yaml"
"$python" -m app.make_shards --config "$config" "$@"
"$python" -m app.make_shards --config "$config" shards.split=test shards.samples=1000 \
    shards.output=data/shards/cluttered-test "$@"
"$python" -m app.graph_precompute --config "$config" "$@"
"$python" -m torch.distributed.run --standalone --nproc_per_node "${NPROC:-2}" \
    -m app.pretrain --config "$config" "$@"
"$python" -m app.evaluate --config "$config" eval.model=models:/cluttered-encoder/latest \
    --promote champion "$@"
echo "demo: report in $(pwd)/runs/cluttered-xclr-demo/eval/report.md"
