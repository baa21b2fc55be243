"""Training on shards served over HTTP (a real ``http.server`` on 127.0.0.1): a run that
is interrupted, finds the server down (one line naming the URL, checkpoint kept) and
resumes once it is back ends with weights bit-identical to an uninterrupted run on the
local folder; the img2dataset recipes run end to end on img2dataset-layout shards."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import torch

from tests.app.helpers import REPO, pretrain_command, run_pretrain, sigkill, train_overrides
from tests.data_pipeline.helpers import uneven_set
from tests.data_pipeline.remote import ShardServer, img2dataset_shards


def final_model(run_dir):
    newest = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    return newest.name, torch.load(newest / "shared.pt", weights_only=True)["model"]


def killed_after(overrides: list[str], checkpoint: Path, log: Path) -> int:
    """Start ``pretrain``, kill it and its children (loader workers, curl) once
    ``checkpoint`` exists; returns the newest step it wrote."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    with open(log, "w") as out:
        run = subprocess.Popen(pretrain_command(overrides), cwd=REPO, env=env, stdout=out,
                               stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 300
        while not checkpoint.exists() and run.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert run.poll() is None, log.read_text()[-3000:]  # still training
        processes = [psutil.Process(run.pid), *psutil.Process(run.pid).children(recursive=True)]
        sigkill(processes)
        run.wait()
    return max(int(p.name[5:]) for p in checkpoint.parent.glob("step_*"))


def test_http_run_resumes_across_a_server_outage_and_equals_the_local_run(tmp_path):
    folder = tmp_path / "shards"
    uneven_set(folder, [40, 30, 26])  # 96 samples: 6 steps an epoch at 16
    server = ShardServer(folder).start()
    url = f"{server.url}/shard-{{000000..000002}}.tar"
    common = {"train.epochs": 4, "checkpoint.every": 3, "data.retries": 2,
              "data.retry_wait": 0.1}
    try:
        local = run_pretrain(train_overrides(folder, tmp_path / "local", **common))
        assert local.returncode == 0, local.stderr[-3000:]
        remote = train_overrides(url, tmp_path / "remote", **common)
        checkpoints = tmp_path / "remote" / "run" / "checkpoints"
        killed_at = killed_after(remote, checkpoints / "step_00000003", tmp_path / "log")
        assert 3 <= killed_at < 24
        server.stop()
        down = run_pretrain(remote)
        assert down.returncode == 1
        shard = f"{server.url}/shard-000000.tar"
        assert down.stderr.strip().splitlines()[-1].startswith(
            f"pretrain: error: {shard}: unreachable after 2 attempts (curl exit status 7)")
        assert final_model(tmp_path / "remote" / "run")[0] == f"step_{killed_at:08d}"  # kept
        server.start()
        resumed = run_pretrain(remote)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert f"step_{killed_at:08d} at step {killed_at}" in resumed.stderr  # resumed there
    finally:
        server.stop()
    step_a, weights_a = final_model(tmp_path / "local" / "run")
    step_b, weights_b = final_model(tmp_path / "remote" / "run")
    assert step_a == step_b == "step_00000024"
    for key, value in weights_a.items():
        assert torch.equal(value, weights_b[key]), key


@pytest.mark.parametrize("recipe", ["cc3m_simclr", "cc12m_clip"])
def test_img2dataset_recipe_trains_on_served_shards(tmp_path, monkeypatch, recipe):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    img2dataset_shards(tmp_path / "web", shards=2, per_shard=24)
    server = ShardServer(tmp_path / "web").start()
    small = ["model.backbone=small_cnn", "model.width=8", "model.projector_hidden=32",
             "model.projector_dim=16", "data.resolution=16", "data.batch_size=8",
             "data.workers=1", "optim.warmup_steps=1", "train.max_steps=2", "train.log_every=1",
             "train.progress=false", "tracking.enabled=false", "train.knn_every=0"]
    try:
        result = run_pretrain(["--config", str(REPO / "launch" / "configs" / f"{recipe}.yaml"),
                               f"data.shards={server.url}/{{00000..00001}}.tar",
                               f"output_dir={tmp_path}", "name=run", *small], timeout=600)
    finally:
        server.stop()
    assert result.returncode == 0, result.stderr[-3000:]
    assert "step 2 " in result.stderr
    assert (tmp_path / "run" / "checkpoints" / "step_00000002" / "shared.pt").is_file()
