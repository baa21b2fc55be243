"""Ports for the servers and rendezvous stores a test starts.

A port the kernel hands out for ``bind(0)`` comes from its ephemeral range, which it also
hands to outgoing connections: free when asked, it can be taken by the time a rank that
first imports torch, or an agent that first starts, binds it. These come from below that
range (``/proc/sys/net/ipv4/ip_local_port_range``), from a block of their own for each
pytest-xdist worker (``PYTEST_XDIST_WORKER``), so that two workers never pick the same port
between its check and its bind, and are checked free before they are handed out."""

from __future__ import annotations

import os
import random
import socket
from pathlib import Path

LOWEST, HIGHEST = 20_000, 32_768  # below Linux's default ephemeral range
RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
ATTEMPTS = 200


def worker_block() -> range:
    """This xdist worker's share of the ports below the ephemeral range (all of them
    outside xdist)."""
    highest = HIGHEST
    if RANGE.is_file():
        highest = min(highest, int(RANGE.read_text().split()[0]))
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    index = int(worker) % workers if worker.isdigit() else 0
    span = max(1, (highest - LOWEST) // workers)
    return range(LOWEST + index * span, LOWEST + (index + 1) * span)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now and that neither an outgoing connection
    nor another xdist worker is given."""
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
