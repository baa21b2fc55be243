"""A process and everything below it, found through /proc: what the kit kills when a part,
or a part's command, runs past its time (a torchrun agent's ranks start sessions of their
own, so a process group does not hold them)."""

from __future__ import annotations

import os
import signal
from pathlib import Path


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``, read from /proc (a part's pytest, torchrun agent and
    ranks, loader workers), children before their own children."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:  # the field after the parenthesised name is the state, then the parent
                stat = (entry / "stat").read_text()
            except OSError:  # ended meanwhile
                continue
            parents[int(entry.name)] = int(stat[stat.rindex(")") + 2:].split()[1])
    found, queue = [], [pid]
    while queue:
        children = [child for child, parent in parents.items() if parent == queue[0]]
        found += children
        queue = queue[1:] + children
    return found


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every process below it. Each is first stopped (SIGSTOP), parents
    before their children, until a fresh read of /proc finds no new one: a stopped process
    starts nothing more and keeps its children below it, where a killed one would hand
    them to init, out of reach."""
    stopped: list[int] = []
    found = [pid]
    while found:
        for member in found:
            _signal(member, signal.SIGSTOP)
        stopped += found
        found = [child for child in descendants(pid) if child not in stopped]
    for member in stopped:
        _signal(member, signal.SIGKILL)


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:  # ended meanwhile
        pass
