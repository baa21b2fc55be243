"""The README's main job (launch/demo_pipeline.sh) end to end in its smallest setting:
cluttered-digits shards, class-template graph, 2-process CPU X-CLR training over gloo,
encoder registered in the run's SQLite MLflow store, evaluated beside an untrained
encoder and promoted.

The script runs as the README runs it, each stage (torchrun's agent and ranks too) forked
from a pre-imported interpreter, its ``PYTHON`` the server's stand-in (``tests/prewarmed.py``).
What this still proves: the stages, in the script's order with its arguments, make the
demo's outputs. Each stage's module started in a fresh interpreter: ``app.pretrain`` and
``app.evaluate`` in the GPU kit's dry run (``tests/bench/gpu/test_gpu_kit.py``, which also
imports ``app.make_shards`` fresh), ``app.graph_precompute`` in
``tests/data_pipeline/graph/test_caption_store.py``."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import mlflow

from tests import prewarmed

REPO = Path(__file__).resolve().parents[2]


def test_demo_pipeline_smallest_setting(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}  # as the script sets
    python = str(prewarmed.server_for(env).python)
    env |= {"DEMO_DIR": str(tmp_path), "PYTHON": python, "PYTHON_EXEC": python}
    result = subprocess.run(
        ["bash", str(REPO / "launch" / "demo_pipeline.sh"), "shards.samples=400",
         "train.max_steps=4", "data.batch_size=32", "checkpoint.every=2",
         "tracking.system_metrics=false", "train.log_every=2", "eval.probe_epochs=5"],
        env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    run_dir = tmp_path / "runs" / "cluttered-xclr-demo"
    assert (tmp_path / "data" / "captions" / "cluttered-train" / "class_graph.npz").is_file()
    assert "2 ranks on cpu" in result.stderr
    assert [p.name for p in sorted((run_dir / "checkpoints").glob("step_*"))] == [
        "step_00000002", "step_00000004"]
    uri = f"sqlite:///{run_dir / 'mlflow.db'}"
    client = mlflow.MlflowClient(uri, registry_uri=uri)
    version = client.get_model_version("cluttered-encoder", "1")
    run = client.get_run(version.run_id)
    assert run.data.params["objective.name"] == "xclr"
    assert run.data.metrics["loss"] > 0 and run.data.metrics["effective_rank"] > 1
    assert str(client.get_model_version_by_alias("cluttered-encoder", "champion").version) == "1"
    results = json.loads((run_dir / "eval" / "results.json").read_text())
    assert results["samples"] == {"train": 400, "test": 400}
    assert set(results["untrained"]["knn"]) == {"backbone", "projector"}
    report = (run_dir / "eval" / "report.md").read_text()
    assert "backbone top-1, untrained" in report and "(untrained: " in report


def test_launch_scripts_parse():
    for script in ("torchrun.sh", "deepspeed.sh", "slurm.sbatch", "demo.sh",
                   "demo_pipeline.sh", "setup.sh", "lock.sh", "serve.sh", "with_step_timer.sh"):
        subprocess.run(["bash", "-n", str(REPO / "launch" / script)], check=True)
