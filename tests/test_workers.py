"""What each pytest-xdist worker gets: its share of the cores, for itself and the processes
it starts, and a block of test ports of its own, below the kernel's ephemeral range."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import torch

from tests import ports
from tests.conftest import share_the_cores


def test_a_worker_and_the_processes_it_starts_take_its_share_of_the_cores(monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    share = str(max(1, (os.cpu_count() or 1) // 2))
    threads = torch.get_num_threads()
    try:
        share_the_cores()
        assert os.environ["OMP_NUM_THREADS"] == share
        assert torch.get_num_threads() == int(share)
    finally:
        torch.set_num_threads(threads)
    child = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
                           capture_output=True, text=True, timeout=120, check=True)
    assert child.stdout.strip() == share


def test_two_workers_draw_from_disjoint_blocks_below_the_ephemeral_range(monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    blocks = []
    for worker in ("gw0", "gw1"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        blocks.append(ports.worker_block())
        port = ports.free_port()
        assert port in blocks[-1]
        with socket.socket() as sock:  # free when handed out
            sock.bind(("127.0.0.1", port))
    assert not set(blocks[0]) & set(blocks[1])
    assert blocks[0].start == ports.LOWEST and len(blocks[0]) > 1000
    if ports.RANGE.is_file():
        assert blocks[1].stop <= int(ports.RANGE.read_text().split()[0])


def test_outside_xdist_every_port_of_the_range_is_drawn_from(monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT", raising=False)
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    block = ports.worker_block()
    assert block.start == ports.LOWEST and block.stop > ports.LOWEST + 10_000
