"""A hang is a fault like a crash (``pretrain/run/hang.py``): two elastic torchrun agents
through ``launch/torchrun.sh`` at the watch's defaults. One node's training process and
its loader worker are frozen with SIGSTOP while its agent lives: the waiting rank names
it in one line, the node's step timer kills it, the group restarts and trains a new step
within 90 s, and the run finishes with every epoch read once. A rank paused for less than
the timeout (SIGSTOP, then SIGCONT) restarts nothing: the same job, first."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.app.helpers import REPO, train_overrides
from tests.launch.runs import step_rows
from tests.launch.test_multinode import elastic_agent, wait_for
from tests.ports import free_port

pytestmark = pytest.mark.long_file  # collected first: tests/conftest.py

SETTINGS = {"checkpoint.every": 4, "data.workers": 1, "train.epochs": 8, "data.ledger": True,
            "train.log_every": 1}
EPOCH_STEPS = 360 // 32  # 360 digits, 16 a rank on 2 ranks


def training_process(agent: subprocess.Popen) -> psutil.Process:
    """The agent's training process: not its loader workers, not its step-timer server."""
    for child in psutil.Process(agent.pid).children():
        if "app.pretrain" in child.cmdline():
            return child
    raise AssertionError("no training process under the agent")


def not_rank_0(agents: list[subprocess.Popen]) -> psutil.Process:
    """The training process of rank 1, whichever agent holds it (ranks follow the nodes'
    addresses and pids, not the order they joined); rank 0's serves the job's store,
    whose freeze is another finding (``tests/launch/test_partition.py``)."""
    ranks = {process.environ()["RANK"]: process for process in map(training_process, agents)}
    return ranks["1"]


def last_step(run: Path) -> int:
    rows = step_rows((run / "train.log").read_text()) if (run / "train.log").exists() else {}
    return max(rows, default=0)


def start_job(digits_shards: Path, tmp_path: Path) -> tuple[list[subprocess.Popen], Path]:
    job = tmp_path / "job.yaml"
    job.write_text("name: run\n")
    overrides = train_overrides(digits_shards, tmp_path, **SETTINGS)
    port, log_path = free_port(), tmp_path / "agents.log"
    log = open(log_path, "w")
    first = elastic_agent(job, overrides, port, log)
    time.sleep(2)  # both join the first round
    second = elastic_agent(job, overrides, port, log)
    return [first, second], log_path


def assert_every_epoch_once(run: Path, epochs: int) -> None:
    counted = subprocess.run([sys.executable, "-m", "data_pipeline.loader.ledger", str(run),
                              "--json"], cwd=REPO, capture_output=True, text=True,
                             timeout=120)
    assert counted.returncode == 0, counted.stderr
    found = json.loads(counted.stdout)["epochs"]
    assert len(found) == epochs, found
    for epoch in found.values():
        assert epoch["skipped"] == 0 and epoch["more_than_once"] == 0, found
        assert epoch["unread"] == 360 - EPOCH_STEPS * 32, found


def test_a_straggler_restarts_nothing_and_a_frozen_rank_is_named_killed_and_healed(
        digits_shards, tmp_path):
    """One job: a 5 s pause (a third of the 15 s floor) restarts nothing; then a freeze
    is named, killed and healed."""
    agents, log_path = start_job(digits_shards, tmp_path)
    run = tmp_path / "run"
    wait_for(lambda: last_step(run) >= 20, 300, agents, log_path)
    straggler = not_rank_0(agents)
    paused = [straggler, *straggler.children(recursive=True)]
    for process in paused:
        process.send_signal(signal.SIGSTOP)
    time.sleep(5)
    for process in paused:
        process.send_signal(signal.SIGCONT)
    wait_for(lambda: last_step(run) >= 34, 300, agents, log_path)
    assert "hang at step" not in log_path.read_text()
    assert "resumed from" not in (run / "train.log").read_text()

    frozen = not_rank_0(agents)
    rank, pid = frozen.environ()["RANK"], frozen.pid
    before = last_step(run)
    stopped = time.monotonic()
    for process in [frozen, *frozen.children(recursive=True)]:
        process.send_signal(signal.SIGSTOP)
    wait_for(lambda: last_step(run) > before + 1, 300, agents, log_path)
    healed_s = time.monotonic() - stopped
    assert [a.wait(timeout=300) for a in agents] == [0, 0], log_path.read_text()[-4000:]
    text = log_path.read_text()
    named = re.search(r"rank\d+ pretrain\.run\.hang ERROR: hang at step \d+: rank \d+ "
                      r"waited (\d+) s in a collective for "
                      rf"rank {rank} on \S+ \(pid {pid}, no heartbeat\)", text)
    assert named, "\n".join(line for line in text.splitlines() if re.search(
        r"hang|step timer|exitcode|SIGTERM|SIGKILL|error", line))[-4000:]
    killed = text.find(f"step timer: rank {rank} (pid {pid}) on")
    assert killed > named.start(), "the step timer killed the frozen rank before it was named"
    assert "restarted after a hang at step" in (run / "train.log").read_text()
    assert healed_s < 90, healed_s
    print(f"healed in {healed_s:.1f} s; waited {named[1]} s")
    assert_every_epoch_once(run, SETTINGS["train.epochs"])
