"""What a worker can tell of the torchrun agent that started it.

An elastic agent (``torchrun --nnodes MIN:MAX`` with MIN < MAX) by default shares its
rendezvous TCP store with its workers (``TORCHELASTIC_USE_AGENT_STORE=True`` in their
environment). With the store shared, a group that has lost a node cannot always take it
back: the agents wait for the new round's ``MASTER_ADDR`` key until the rendezvous times out
and the job ends. Setting ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` in the agents' environment
gives every round a store of its own; ``launch/torchrun.sh`` sets it. The choice is the
agent's, made before any worker starts, so a worker can only say so.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

FIX = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def agent_arguments(pid: int | None = None) -> list[str]:
    """The command line of process ``pid`` (default: this process's parent, the agent);
    [] where it cannot be read."""
    pid = os.getppid() if pid is None else pid
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def node_range(arguments: Sequence[str]) -> tuple[int, int] | None:
    """``--nnodes`` of a torchrun command line as (min, max); None when absent or not
    numbers."""
    for index, argument in enumerate(arguments):
        if argument == "--nnodes" and index + 1 < len(arguments):
            value = arguments[index + 1]
        elif argument.startswith("--nnodes="):
            value = argument.removeprefix("--nnodes=")
        else:
            continue
        low, _, high = value.partition(":")
        try:
            return int(low), int(high or low)
        except ValueError:
            return None
    return None


def shared_store_warning(environ: Mapping[str, str], arguments: Sequence[str]) -> str | None:
    """The one line a worker logs when its elastic agent shares its rendezvous store;
    None otherwise."""
    if environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    nodes = node_range(arguments)
    if nodes is None or nodes[0] == nodes[1]:
        return None
    return (f"torchrun --nnodes {nodes[0]}:{nodes[1]} shares its rendezvous store with the "
            "workers (torch's default): a node lost and started again may not rejoin (the "
            f"agents time out waiting for MASTER_ADDR); start every agent with {FIX}=1 in "
            "its environment, or with launch/torchrun.sh, which sets it")
