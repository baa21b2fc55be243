#!/usr/bin/env bash
# The main job on the embedded defaults (local CPU, bundled data), as far as it has landed:
# digits -> WebDataset shards -> caption store + class-template graph -> one loader batch ->
# every objective on it. The training stage (issue #4) will replace the last two steps.
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup.sh dev,bench
export HF_HUB_OFFLINE=1
config=launch/configs/demo.yaml
.venv/bin/make-shards --config "$config"
.venv/bin/graph-precompute --config "$config"
.venv/bin/graph-precompute --config "$config" graph.task=class_graph
.venv/bin/graph-precompute --config "$config" graph.task=neighbours graph.neighbours=3
.venv/bin/graph-precompute --config "$config" graph.task=show graph.key=digits_00001
.venv/bin/python -m pretrain.demo_batch --config "$config"
.venv/bin/python -m bench.objectives --sizes 1024
