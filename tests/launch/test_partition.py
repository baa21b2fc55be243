"""A partitioned node: two hosts in network namespaces this test creates (``ip netns``, one
veth pair, addresses of their own and no route beyond them: nothing leaves the machine),
each with its own hostname and a torchrun agent of ``launch/torchrun.sh`` (``NNODES=1:2``);
the rendezvous store runs on host A. Host B's link is cut mid-run (``ip link set ...
down``): its sockets stay open and nothing dies, so the hang watch finds it
(``pretrain/run/hang.py``); the survivor names host B and goes on alone; when the link
returns, the group grows back to 2. Then both agents are sent SIGTERM (the run ends
preempted, at a checkpoint, instead of running out its epochs at whatever pace the node
came back): every epoch it finished was read once, the one it stopped in at most once.
Needs root (namespaces); elsewhere it says so in its skip reason."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from tests.app.helpers import REPO, train_overrides
from tests.launch.test_hang import EPOCH_STEPS, last_step
from tests.launch.test_multinode import wait_for

pytestmark = pytest.mark.long_file  # collected first: tests/conftest.py

EPOCHS = 1000  # more than it trains: it ends preempted
PORT = 29400  # on host A's own network


@dataclass
class Host:
    netns: str
    link: str
    address: str
    name: str

    def run(self, *command: str, **kwargs) -> subprocess.Popen:
        """``command`` on this host: its network namespace, its hostname."""
        return subprocess.Popen(["ip", "netns", "exec", self.netns, "unshare", "--uts", "sh",
                                 "-c", f'hostname {self.name} && exec "$@"', "sh", *command],
                                **kwargs)


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@pytest.fixture
def hosts() -> Iterator[tuple[Host, Host]]:
    """Two namespaces joined by a veth pair on a /30 of their own (named by this process, so
    that parallel test processes do not meet)."""
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("unshare") is None:
        pytest.skip("network namespaces need root, iproute2 and unshare: not here")
    tag, subnet = f"cpt{os.getpid()}", f"10.{200 + os.getpid() % 50}.{os.getpid() % 250}"
    pair = (Host(f"{tag}a", f"{tag}a0", f"{subnet}.1", "host-a"),
            Host(f"{tag}b", f"{tag}b0", f"{subnet}.2", "host-b"))
    try:
        for host in pair:
            ip("netns", "add", host.netns)
    except subprocess.CalledProcessError as err:
        for host in pair:
            subprocess.run(["ip", "netns", "del", host.netns], capture_output=True)
        pytest.skip(f"cannot create a network namespace here: {err.stderr.strip()}")
    try:
        ip("link", "add", pair[0].link, "type", "veth", "peer", "name", pair[1].link)
        for host in pair:
            ip("link", "set", host.link, "netns", host.netns)
            ip("-n", host.netns, "addr", "add", f"{host.address}/30", "dev", host.link)
            ip("-n", host.netns, "link", "set", "lo", "up")
            ip("-n", host.netns, "link", "set", host.link, "up")
        probe = pair[1].run("true")
        if probe.wait(timeout=30):
            pytest.skip("a host's own hostname needs unshare --uts: refused here")
        yield pair
    finally:
        subprocess.run(["ip", "link", "del", pair[0].link], capture_output=True)  # if left
        for host in pair:  # a veth pair moved into them goes with its namespaces
            subprocess.run(["ip", "netns", "del", host.netns], capture_output=True)


def routes(host: Host) -> str:
    return subprocess.run(["ip", "-n", host.netns, "route"], capture_output=True, text=True,
                          check=True).stdout


def end_tree(process: subprocess.Popen) -> None:
    """The process and every process under it (torch starts each worker in a session of
    its own, out of reach of a process-group kill)."""
    try:
        tree = [psutil.Process(process.pid), *psutil.Process(process.pid).children(True)]
    except psutil.NoSuchProcess:
        tree = []
    for member in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            member.kill()
    process.wait()


def worlds(log: Path) -> list[int]:
    """The world of each group rank 0 began, in order."""
    return [int(n) for n in re.findall(r"rank0 pretrain INFO: (\d+) ranks on ",
                                       log.read_text())]


def assert_read_at_most_once(run: Path) -> None:
    """Every epoch the run finished read once (but the last partial global batch), the
    epoch it stopped in at most once."""
    counted = subprocess.run([sys.executable, "-m", "data_pipeline.loader.ledger", str(run),
                              "--json"], cwd=REPO, capture_output=True, text=True,
                             timeout=120, check=True)
    epochs = [epoch for _, epoch in sorted(json.loads(counted.stdout)["epochs"].items(),
                                           key=lambda item: int(item[0]))]
    assert len(epochs) >= 2, epochs
    for epoch in epochs:
        assert epoch["skipped"] == 0 and epoch["more_than_once"] == 0, epochs
    for epoch in epochs[:-1]:
        assert epoch["unread"] == 360 - EPOCH_STEPS * 32, epochs


def test_a_partitioned_node_is_named_left_out_and_taken_back(digits_shards, tmp_path, hosts):
    a, b = hosts
    assert "default" not in routes(a) + routes(b)  # only each other's address is reachable
    job = tmp_path / "job.yaml"
    job.write_text("name: run\n")
    overrides = train_overrides(digits_shards, tmp_path, **{
        "checkpoint.every": 4, "data.workers": 1, "train.epochs": EPOCHS,
        "data.ledger": True, "train.log_every": 1, "data.resolution": 32})
    log_path, run = tmp_path / "agents.log", tmp_path / "run"
    log = open(log_path, "w")
    store = a.run(sys.executable, "-c", "import time; from torch.distributed import TCPStore; "
                  f"s = TCPStore('{a.address}', {PORT}, is_master=True, "
                  "wait_for_workers=False); time.sleep(10**6)", cwd=REPO, stdout=log,
                  stderr=subprocess.STDOUT)
    agents = []
    try:
        for host in hosts:
            env = {**os.environ, "NNODES": "1:2", "RDZV_ENDPOINT": f"{a.address}:{PORT}",
                   "RDZV_ID": "partition", "NPROC": "1", "MAX_RESTARTS": "6",
                   "OMP_NUM_THREADS": "1", "LOCAL_ADDR": host.address,
                   "GLOO_SOCKET_IFNAME": host.link,
                   "RDZV_CONF": "is_host=0,last_call_timeout=2,keep_alive_interval=1"}
            agents.append(host.run("bash", "launch/torchrun.sh", str(job), *overrides,
                                   cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True))
            time.sleep(2)  # both join the first round
        wait_for(lambda: worlds(log_path)[-1:] == [2] and last_step(run) >= 20, 300, agents,
                 log_path)  # (A may have begun alone, B joining a round later)
        formed = len(worlds(log_path))
        ip("-n", b.netns, "link", "set", b.link, "down")
        cut, before = time.monotonic(), last_step(run)
        wait_for(lambda: worlds(log_path)[-1:] == [1], 300, agents, log_path)
        wait_for(lambda: last_step(run) > before, 120, agents, log_path)  # a new step, alone
        alone_s = time.monotonic() - cut
        alone = last_step(run)
        wait_for(lambda: last_step(run) > alone + 1, 120, agents, log_path)
        ip("-n", b.netns, "link", "set", b.link, "up")
        back = time.monotonic()
        wait_for(lambda: worlds(log_path)[-1:] == [2], 300, agents, log_path)
        together = last_step(run)
        wait_for(lambda: last_step(run) > together, 120, agents, log_path)
        print(f"partition: a new step alone {alone_s:.1f} s after the cut; a step of the 2 "
              f"again {time.monotonic() - back:.1f} s after the link returned")
        wait_for(lambda: last_step(run) > together + 2, 120, agents, log_path)
        for agent in agents:
            agent.send_signal(signal.SIGTERM)
        for agent in agents:
            agent.wait(timeout=300)
    finally:
        for process in [*agents, store]:
            end_tree(process)
        log.close()
    text = log_path.read_text()
    assert worlds(log_path)[formed - 1:] == [2, 1, 2], text[-4000:]
    assert alone_s < 90, alone_s  # as a frozen rank's target (docs/benchmarks.md)
    assert re.search(r"hang at step \d+: rank \d waited \d+ s in a collective for rank \d "
                     r"on host-b \(pid \d+, no heartbeat\)", text), text[-4000:]  # host A's
    assert re.search(r"hang at step \d+: rank \d waited \d+ s in a collective and the job's "
                     "store .* does not answer", text), text[-4000:]  # host B's
    assert "restarted after a hang at step" in (run / "train.log").read_text()
    assert "preempted by SIGTERM" in text and (run / "preempted").exists(), text[-4000:]
    assert_read_at_most_once(run)
