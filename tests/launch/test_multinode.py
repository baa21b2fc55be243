"""More than one node, as ``launch/slurm.sbatch`` runs it: one torchrun agent per node with
c10d rendezvous (here two agents on 127.0.0.1 sharing the run directory, as nodes share a
file system). They train, checkpoint, are killed together and resume; the weights equal a
1-node 2-process run's bit for bit (same ranks, same chunks, same reductions). And the
elastic launch (``launch/torchrun.sh`` with ``NNODES=1:2``), in float64: a node lost and
regained while the job runs, and the run ends where the uninterrupted 2-process run does
(its weights, every step's loss and samples), every sample of every epoch trained on once.
The same killed and resumed on 2 -> 1 -> 3 ranks: ``test_world_invariance.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from tests.app.helpers import REPO, sigkill, train_overrides
from tests.data_pipeline.helpers import assert_ledger_by_keys
from tests.launch.runs import assert_same_run, step_rows
from tests.ports import free_port
from tests.pretrain.run.test_checkpoint import final_model

pytestmark = pytest.mark.long_file  # collected first: tests/conftest.py

COMMON = {"checkpoint.every": 4, "data.workers": 1, "train.max_steps": 24}


def start_agents(overrides: list[str], port: int, log) -> list[subprocess.Popen]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    agents = []
    for node in range(2):
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                   "--nproc_per_node", "1", "--rdzv_backend", "c10d",
                   "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", "two-nodes",
                   "--rdzv_conf", f"is_host={int(node == 0)}", "-m", "app.pretrain",
                   *overrides]
        agents.append(subprocess.Popen(command, cwd=REPO, env=env, stdout=log,
                                       stderr=subprocess.STDOUT, start_new_session=True))
    return agents


def test_two_agents_train_are_killed_resume_and_equal_one_node(digits_shards, uninterrupted,
                                                              tmp_path):
    reference = uninterrupted(2, **COMMON)

    overrides = train_overrides(digits_shards, tmp_path / "b", **COMMON)
    log = open(tmp_path / "agents.log", "w")
    agents = start_agents(overrides, free_port(), log)
    first = tmp_path / "b" / "run" / "checkpoints" / "step_00000008"
    deadline = time.monotonic() + 300
    while not first.exists() and all(a.poll() is None for a in agents) \
            and time.monotonic() < deadline:
        time.sleep(0.02)
    assert all(a.poll() is None for a in agents), (tmp_path / "agents.log").read_text()[-3000:]
    processes = [psutil.Process(a.pid) for a in agents]
    processes += [child for p in processes for child in p.children(recursive=True)]
    assert len(processes) >= 4  # two agents, each with its worker
    sigkill(processes)  # the job is preempted: every process of both nodes dies
    for agent in agents:
        agent.wait()
    killed_at = max(int(p.name[5:]) for p in first.parent.glob("step_*"))
    assert 8 <= killed_at < 24

    agents = start_agents(overrides, free_port(), log)
    assert [a.wait(timeout=300) for a in agents] == [0, 0], \
        (tmp_path / "agents.log").read_text()[-3000:]
    assert f"at step {killed_at}" in (tmp_path / "agents.log").read_text()
    a, b = final_model(reference), final_model(tmp_path / "b" / "run")
    assert a["step"] == b["step"] == 24 and b["world"] == 2
    for key, value in a["model"].items():
        assert torch.equal(value, b["model"][key]), key


def elastic_agent(job: Path, overrides: list[str], port: int, log) -> subprocess.Popen:
    """One node of an elastic job: ``launch/torchrun.sh`` in its elastic mode, 1 process."""
    env = {**os.environ, "NNODES": "1:2", "RDZV_ENDPOINT": f"127.0.0.1:{port}",
           "RDZV_ID": "elastic-test", "NPROC": "1", "MAX_RESTARTS": "6",
           "OMP_NUM_THREADS": "1", "RDZV_CONF": "last_call_timeout=10,keep_alive_interval=1"}
    return subprocess.Popen(["bash", "launch/torchrun.sh", str(job), *overrides], cwd=REPO,
                            env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def wait_for(condition, seconds: float, agents: list[subprocess.Popen], log: Path) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline and all(a.poll() is None for a in agents), \
            log.read_text()[-4000:]
        time.sleep(0.1)


ELASTIC = {"checkpoint.every": 4, "data.workers": 1, "train.epochs": 5, "data.ledger": True,
           "train.log_every": 1, "train.precision": "fp64"}
EPOCH_STEPS, GLOBAL_BATCH = 360 // 32, 32  # 360 digits, 16 a rank on the 2 ranks it began with


def test_a_node_lost_and_regained_trains_every_epoch_once_as_asked(digits_shards, uninterrupted,
                                                                   tmp_path):
    """Two elastic agents (``NNODES=1:2``), a ledger kept, ``train.epochs`` asked. Mid-epoch
    the second node and every process under it are SIGKILLed, as a lost node loses them:
    the first continues at world 1 from the newest checkpoint, its rank taking both chunks
    of the global batch. The second is started again: the group grows back to 2 and
    finishes. The run is the uninterrupted 2-process run: its final weights to 1e-9
    relative (float64), every step's loss, learning rate and samples (the ledger), and
    every epoch, the last included, trains on every sample of the shards once (none unread
    beyond the last partial global batch)."""
    uninterrupted_run = uninterrupted(2, **ELASTIC)
    reference = step_rows((uninterrupted_run / "train.log").read_text())
    job = tmp_path / "job.yaml"
    job.write_text("name: run\n")
    overrides = train_overrides(digits_shards, tmp_path, **ELASTIC)
    port, log_path = free_port(), tmp_path / "agents.log"
    log = open(log_path, "w")
    text = log_path.read_text
    first = elastic_agent(job, overrides, port, log)  # hosts the rendezvous store
    time.sleep(2)  # both join the first round (RDZV_CONF: it waits 10 s for more nodes)
    second = elastic_agent(job, overrides, port, log)
    checkpoints = tmp_path / "run" / "checkpoints"
    wait_for(lambda: (checkpoints / "step_00000008").exists(), 300, [first, second], log_path)
    assert "2 ranks on cpu" in text()
    lost = psutil.Process(second.pid)
    sigkill([lost, *lost.children(recursive=True)])
    second.wait()
    wait_for(lambda: "written by 2 ranks, resumed on 1" in text(), 300, [first], log_path)
    second = elastic_agent(job, overrides, port, log)
    assert [a.wait(timeout=300) for a in (first, second)] == [0, 0], text()[-4000:]
    assert "written by 1 ranks, resumed on 2" in text()
    assert "global batch 32 on 1 rank(s): 2 chunk(s) of 16 instances a rank, encoded in " \
           "pieces of at most 32 rows" in text()
    final = final_model(tmp_path / "run")
    assert final["step"] == 5 * EPOCH_STEPS and final["world"] == 2

    rows = step_rows((tmp_path / "run" / "train.log").read_text())
    assert sorted(rows) == sorted(reference) == list(range(1, 5 * EPOCH_STEPS + 1))
    for step, logged in rows.items():
        for row in logged:  # before, during and after the change, and steps trained again
            assert row["lr"] == reference[step][0]["lr"], (step, row, reference[step])

    counted = subprocess.run([sys.executable, "-m", "data_pipeline.loader.ledger",
                              str(tmp_path / "run"), "--json", "--keys"], cwd=REPO,
                             capture_output=True, text=True, timeout=120)
    assert counted.returncode == 0, counted.stderr
    epochs = json.loads(counted.stdout)["epochs"]
    assert len(epochs) == 5, epochs
    for epoch in epochs.values():
        assert epoch["skipped"] == 0 and epoch["more_than_once"] == 0, epochs
        assert epoch["unread"] == 360 - EPOCH_STEPS * GLOBAL_BATCH, epochs
    assert_ledger_by_keys(epochs, tmp_path / "run", digits_shards, full=5)
    assert_same_run(uninterrupted_run, tmp_path / "run", 5 * EPOCH_STEPS)
