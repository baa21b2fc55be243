"""The README's main job (launch/demo_pipeline.sh) end to end in its smallest setting:
digits shards, class-template graph, 2-process CPU X-CLR training over gloo, encoder
registered in the run's SQLite MLflow store."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import mlflow

REPO = Path(__file__).resolve().parents[2]


def test_demo_pipeline_smallest_setting(tmp_path):
    env = {**os.environ, "DEMO_DIR": str(tmp_path)}
    result = subprocess.run(
        ["bash", str(REPO / "launch" / "demo_pipeline.sh"), "train.max_steps=4",
         "data.batch_size=32", "checkpoint.every=2", "tracking.system_metrics=false",
         "train.log_every=2"], env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    run_dir = tmp_path / "runs" / "digits-xclr-demo"
    assert (tmp_path / "data" / "captions" / "digits-train" / "class_graph.npz").is_file()
    assert "2 ranks on cpu" in result.stderr
    assert [p.name for p in sorted((run_dir / "checkpoints").glob("step_*"))] == [
        "step_00000002", "step_00000004"]
    uri = f"sqlite:///{run_dir / 'mlflow.db'}"
    client = mlflow.MlflowClient(uri, registry_uri=uri)
    version = client.get_model_version("digits-encoder", "1")
    run = client.get_run(version.run_id)
    assert run.data.params["objective.name"] == "xclr"
    assert run.data.metrics["loss"] > 0


def test_launch_scripts_parse():
    for script in ("torchrun.sh", "deepspeed.sh", "slurm.sbatch", "demo.sh",
                   "demo_pipeline.sh", "setup.sh"):
        subprocess.run(["bash", "-n", str(REPO / "launch" / script)], check=True)
