"""The session's end finds what a test left running: an orphaned process of this session
(and not one of another), and non-daemon threads."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

from tests.leftovers import MARK, lingering_threads, remove_strays, stray_processes

ORPHAN = ("import os, sys, time\n"
          "if os.fork() == 0:\n"
          "    open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(120)\n"
          "os._exit(0)\n")


def orphan(env: dict[str, str], pid_file: Path) -> psutil.Process:
    """A process whose parent has exited: it belongs to no one's children. (It holds no
    pipe of ours: one that did would keep ``subprocess.run`` waiting, as it would CI.)"""
    subprocess.run([sys.executable, "-c", ORPHAN, str(pid_file)], env=env, timeout=60,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    deadline = time.monotonic() + 30
    while not pid_file.is_file() or not pid_file.read_text():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return psutil.Process(int(pid_file.read_text()))


def test_an_orphan_of_this_session_is_found_and_killed_and_another_sessions_is_not(tmp_path):
    mine = orphan(dict(os.environ), tmp_path / "mine")
    theirs = orphan({**os.environ, MARK: "another-session"}, tmp_path / "theirs")
    try:
        found = {p.pid for p in stray_processes(os.environ[MARK])}
        assert mine.pid in found and theirs.pid not in found
        killed = remove_strays(os.environ[MARK])
        assert any(line.startswith(f"pid {mine.pid}: ") for line in killed), killed
        assert not mine.is_running() or mine.status() == psutil.STATUS_ZOMBIE
        assert theirs.is_running()
    finally:
        for proc in (mine, theirs):
            if proc.is_running():
                proc.kill()


def test_a_non_daemon_thread_is_named():
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait, name="left-behind")
    thread.start()
    try:
        assert "left-behind" in lingering_threads()
    finally:
        stop.set()
        thread.join()
    time.sleep(0.01)
    assert "left-behind" not in lingering_threads()


def test_a_thread_pools_workers_are_not_lingering():
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(2, thread_name_prefix="pool")
    try:
        pool.submit(time.sleep, 0.01).result()
        assert not [name for name in lingering_threads() if name.startswith("pool")]
    finally:
        pool.shutdown()
