"""What the test session leaves running when it ends, and its removal.

A process a test started and lost (an orphaned loader worker, a server whose test was
interrupted) keeps the output pipe of whoever runs the suite open, so CI waits for it
until its own time limit; a non-daemon thread keeps the interpreter from exiting. The
session's end reports each by name, so the test that leaked it can be fixed, and removes
it, so the suite's result is what its tests said."""

from __future__ import annotations

import os
import threading
import time

import psutil

WAIT_S = 5.0  # a process that is already on its way out gets this long first


MARK = "CONTRASTIVE_TEST_SESSION"  # set for the session; inherited by what its tests start


def mark_session() -> str:
    """Tag this session's environment so that its processes can be told from any other's
    (another suite running beside it on the same interpreter)."""
    os.environ[MARK] = f"{os.getpid()}-{time.time_ns()}"
    return os.environ[MARK]


def stray_processes(mark: str) -> list[psutil.Process]:
    """Processes of this session still running: descendants of this process, and orphaned
    processes whose environment carries this session's ``mark``."""
    me = psutil.Process()
    found = {p.pid: p for p in me.children(recursive=True)}
    for proc in psutil.process_iter():
        if proc.pid == me.pid or proc.pid in found:
            continue
        try:
            if proc.environ().get(MARK) == mark:
                found[proc.pid] = proc
        except (psutil.Error, OSError):
            continue
    return [p for p in found.values() if not _is_resource_tracker(p)]


def _is_resource_tracker(proc: psutil.Process) -> bool:
    try:  # multiprocessing's own helper: it ends with this process
        return "resource_tracker" in " ".join(proc.cmdline())
    except psutil.Error:
        return True


def describe(proc: psutil.Process) -> str:
    try:
        return f"pid {proc.pid}: {' '.join(proc.cmdline())[:300]}"
    except psutil.Error:
        return f"pid {proc.pid}"


def remove_strays(mark: str) -> list[str]:
    """Kill the stray processes (after :data:`WAIT_S` for those already leaving); their
    descriptions."""
    strays = stray_processes(mark)
    if not strays:
        return []
    _, alive = psutil.wait_procs(strays, timeout=WAIT_S)
    described = [describe(p) for p in alive]
    for proc in alive:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=WAIT_S)
    return described


def lingering_threads() -> list[str]:
    """Non-daemon threads other than the main one that would hold the interpreter open
    (a thread pool's workers are told to end at exit, and do)."""
    from concurrent.futures.thread import _worker as pool_worker

    return [t.name for t in threading.enumerate()
            if t is not threading.main_thread() and not t.daemon and t.is_alive()
            and getattr(t, "_target", None) is not pool_worker]
