"""The demo's batch step (README's first command) runs on real shards."""

from __future__ import annotations

import subprocess
import sys

import numpy as np

from data_pipeline.config import ShardsConfig
from data_pipeline.make_shards import make_shards


def test_demo_batch_runs_every_objective(tmp_path):
    make_shards(ShardsConfig(output=str(tmp_path / "shards"), split="test", workers=1))
    names = np.random.default_rng(0).normal(size=(10, 8))
    names /= np.linalg.norm(names, axis=1, keepdims=True)
    (tmp_path / "graph").mkdir()
    np.savez(tmp_path / "graph" / "class_graph.npz", graph=names @ names.T,
             class_names=np.array([str(i) for i in range(10)]))
    run = subprocess.run(
        [sys.executable, "-m", "pretrain.demo_batch", f"data.shards={tmp_path / 'shards'}",
         "data.workers=0", "data.batch_size=16", f"graph.output={tmp_path / 'graph'}"],
        capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    for name in ("infonce", "supcon", "sincere", "xclr", "projnce", "clip"):
        assert f"  {name} " in run.stdout
