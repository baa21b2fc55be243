"""Ports for the servers and rendezvous stores a test starts.

A port the kernel hands out for ``bind(0)`` comes from its ephemeral range, which it also
hands to outgoing connections: free when asked, it can be taken by the time a rank that
first imports torch, or an agent that first starts, binds it. These come from below that
range (``/proc/sys/net/ipv4/ip_local_port_range``) and are checked free before they are
handed out."""

from __future__ import annotations

import random
import socket
from pathlib import Path

LOWEST, HIGHEST = 20_000, 32_768  # below Linux's default ephemeral range
RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
ATTEMPTS = 200


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now and that no outgoing connection is given."""
    highest = HIGHEST
    if RANGE.is_file():
        highest = min(highest, int(RANGE.read_text().split()[0]))
    for _ in range(ATTEMPTS):
        port = random.randrange(LOWEST, max(highest, LOWEST + 1))
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port in {LOWEST}-{highest - 1} after {ATTEMPTS} tries")
