"""Ports for the servers and rendezvous stores a test starts.

A port the kernel hands out for ``bind(0)`` comes from its ephemeral range, which it also
hands to outgoing connections: free when asked, it can be taken by the time a rank that
first imports torch, or an agent that first starts, binds it, the more so with a second
pytest-xdist worker busy beside the test. These come from below the ephemeral range
(``/proc/sys/net/ipv4/ip_local_port_range``), from a block of their own for each xdist
worker (``PYTEST_XDIST_WORKER``), and are checked free before they are handed out."""

from __future__ import annotations

import os
import random
import socket
from pathlib import Path

LOWEST, HIGHEST = 20_000, 32_768  # the block the workers share, below Linux's default range
RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
ATTEMPTS = 200


def worker_block() -> range:
    """This xdist worker's share of the ports below the ephemeral range (all of them
    outside xdist)."""
    highest = HIGHEST
    if RANGE.is_file():
        highest = min(highest, int(RANGE.read_text().split()[0]))
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    index = int(worker) if worker.isdigit() else 0
    span = max(1, (highest - LOWEST) // count)
    return range(LOWEST + index * span, LOWEST + (index + 1) * span)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now and that no outgoing connection nor another
    xdist worker is given."""
    block = worker_block()
    for _ in range(ATTEMPTS):
        port = random.choice(block)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port in {block.start}-{block.stop - 1} after {ATTEMPTS} tries")
