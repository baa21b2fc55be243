"""More than one node, as ``launch/slurm.sbatch`` runs it: one torchrun agent per node with
c10d rendezvous (here two agents on 127.0.0.1 sharing the run directory, as nodes share a
file system). They train, checkpoint, are killed together and resume; the weights equal a
1-node 2-process run's bit for bit (same ranks, same streams, same reductions)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil
import torch

from core.runtime import free_port
from tests.app.helpers import REPO, run_pretrain, sigkill, train_overrides
from tests.pretrain.run.test_checkpoint import final_model

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


def test_two_agents_train_are_killed_resume_and_equal_one_node(digits_shards, tmp_path):
    reference = run_pretrain(train_overrides(digits_shards, tmp_path / "a", **COMMON), nproc=2)
    assert reference.returncode == 0, reference.stderr[-3000:]

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
    a, b = final_model(tmp_path / "a" / "run"), final_model(tmp_path / "b" / "run")
    assert a["step"] == b["step"] == 24 and b["world"] == 2
    for key, value in a["model"].items():
        assert torch.equal(value, b["model"][key]), key
