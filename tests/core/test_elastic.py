"""The one line a worker of an elastic torchrun agent that shares its rendezvous store
logs: unit cases of what the agent's environment and command line say, and plain
``torchrun --nnodes 1:2`` starting a real run."""

from __future__ import annotations

import os
import subprocess
import sys

import psutil
import pytest

from core.elastic import FIX, agent_arguments, node_range, shared_store_warning
from tests.app.helpers import REPO, train_overrides
from tests.ports import free_port

SHARED = {"TORCHELASTIC_USE_AGENT_STORE": "True"}


@pytest.mark.parametrize(("arguments", "nodes"), [
    (["torchrun", "--nnodes", "1:2", "x.py"], (1, 2)),
    (["python", "-m", "torch.distributed.run", "--nnodes=2:4"], (2, 4)),
    (["torchrun", "--nnodes", "2"], (2, 2)),
    (["torchrun", "--standalone"], None),
    (["torchrun", "--nnodes", "a:b"], None),
])
def test_the_node_range_is_read_from_the_agents_command_line(arguments, nodes):
    assert node_range(arguments) == nodes


def test_only_an_elastic_agent_sharing_its_store_is_warned_of():
    elastic = ["torchrun", "--nnodes", "1:2"]
    line = shared_store_warning(SHARED, elastic)
    assert line is not None and f"{FIX}=1" in line and "launch/torchrun.sh" in line
    assert "\n" not in line
    assert shared_store_warning({"TORCHELASTIC_USE_AGENT_STORE": "False"}, elastic) is None
    assert shared_store_warning({}, elastic) is None  # not started by an agent
    assert shared_store_warning(SHARED, ["torchrun", "--nnodes", "2:2"]) is None
    assert shared_store_warning(SHARED, ["torchrun", "--standalone"]) is None


def test_a_process_command_line_is_read_as_the_system_lists_it():
    assert agent_arguments(os.getpid()) == psutil.Process().cmdline()
    assert agent_arguments() == psutil.Process().parent().cmdline()
    assert agent_arguments(2**22 + 7) == []  # no such process


def test_plain_torchrun_with_a_node_range_tells_the_user_in_one_line(digits_shards, tmp_path):
    """``torchrun --nnodes 1:2`` with torch's defaults, one node: the run trains, and its
    log names the consequence and the fix once; the same agent with the fix set says
    nothing of it."""
    for fix, told in ((None, 1), ("1", 0)):
        overrides = train_overrides(digits_shards, tmp_path / str(fix),
                                    **{"train.max_steps": 1, "data.workers": 0})
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2",
                   "--nproc_per_node", "1", "--rdzv_backend", "c10d", "--rdzv_endpoint",
                   f"127.0.0.1:{free_port()}", "--rdzv_id", "plain", "--rdzv_conf",
                   "last_call_timeout=1", "-m", "app.pretrain", *overrides]
        env = {k: v for k, v in os.environ.items() if k != FIX}
        env.update(OMP_NUM_THREADS="1", **({FIX: fix} if fix else {}))
        done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        lines = [line for line in done.stderr.splitlines() if f"{FIX}=1" in line]
        assert len(lines) == told, done.stderr[-3000:]
