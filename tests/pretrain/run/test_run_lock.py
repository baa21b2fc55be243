"""One run per directory: a second start fails at once naming the holder; a lock whose
holder is gone (dead pid on this host, or no heartbeat) is taken over."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from core.errors import RunError
from pretrain.run.preemption import PREEMPTED_EXIT_STATUS
from pretrain.run.run_lock import LOCK, RunLock
from tests.app.helpers import REPO, pretrain_command, run_pretrain, train_overrides


def write_lock(run_dir, host: str, pid: int, age_s: float = 0.0) -> None:
    path = run_dir / LOCK
    path.write_text(json.dumps({"host": host, "pid": pid, "started": "then", "token": "x"}))
    os.utime(path, (time.time() - age_s, time.time() - age_s))


def dead_pid() -> int:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    return int(done.stdout)


def test_a_held_lock_refuses_a_second_holder_naming_it(tmp_path):
    with RunLock(tmp_path) as first:
        with pytest.raises(RunError) as refused:
            RunLock(tmp_path).acquire()
        message = str(refused.value)
        assert str(tmp_path) in message and f"pid {os.getpid()}" in message
        assert first.record["host"] in message
    assert not (tmp_path / LOCK).exists()  # released
    with RunLock(tmp_path):
        pass


@pytest.mark.parametrize("host,pid,age,taken", [
    ("this", "dead", 0, True),        # crashed or SIGKILLed here: its pid is gone
    ("this", "alive", 0, False),      # still running here
    ("elsewhere", 12345, 0, False),   # another node, heartbeat fresh
    ("elsewhere", 12345, 120, True),  # another node lost: no heartbeat for 2 minutes
])
def test_a_lock_is_taken_over_only_when_its_holder_is_gone(tmp_path, host, pid, age, taken):
    lock = RunLock(tmp_path)
    host = lock.record["host"] if host == "this" else host
    pid = {"dead": dead_pid(), "alive": os.getppid()}.get(pid, pid)
    write_lock(tmp_path, host, pid, age)
    if taken:
        with lock:
            assert json.loads((tmp_path / LOCK).read_text())["token"] == lock.token
    else:
        with pytest.raises(RunError, match=f"in use by pid {pid} on {host}"):
            lock.acquire()
        assert json.loads((tmp_path / LOCK).read_text())["pid"] == pid  # left as it was


def test_the_heartbeat_refreshes_the_lock(tmp_path):
    with RunLock(tmp_path, heartbeat_s=0.05):
        os.utime(tmp_path / LOCK, (time.time() - 100, time.time() - 100))
        time.sleep(0.3)
        assert time.time() - (tmp_path / LOCK).stat().st_mtime < 5


def test_a_second_pretrain_in_the_same_directory_fails_at_once(digits_shards, tmp_path):
    overrides = train_overrides(digits_shards, tmp_path, **{"train.max_steps": 5000,
                                                            "data.workers": 1,
                                                            "checkpoint.every": 0})
    log = tmp_path / "first.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(log, "w") as out:
        first = subprocess.Popen(pretrain_command(overrides), cwd=REPO, env=env, stdout=out,
                                 stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while "INFO: step 2 " not in log.read_text() and first.poll() is None \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        assert first.poll() is None, log.read_text()[-3000:]
        second = run_pretrain(overrides)
        assert first.poll() is None  # refused while the first trains on
        first.send_signal(signal.SIGTERM)  # then stopped as a cluster would stop it
        assert first.wait(timeout=300) == PREEMPTED_EXIT_STATUS, log.read_text()[-3000:]
    assert second.returncode == 1
    lines = second.stderr.strip().splitlines()
    assert lines[-1].startswith(f"pretrain: error: {tmp_path / 'run'} is in use by pid "
                                f"{first.pid} on "), second.stderr[-2000:]
    assert "Traceback" not in second.stderr
    assert "resumed" not in log.read_text()  # the first run trained alone
    assert len(list((tmp_path / "run" / "checkpoints").glob("step_*"))) == 1  # its own
    assert not (tmp_path / "run" / LOCK).exists()  # released when it stopped


def test_a_killed_runs_lock_is_taken_over_by_its_resume(digits_shards, tmp_path):
    overrides = train_overrides(digits_shards, tmp_path, **{"train.max_steps": 40,
                                                            "data.workers": 1,
                                                            "checkpoint.every": 2})
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    first = subprocess.Popen(pretrain_command(overrides), cwd=REPO, env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    checkpoint = tmp_path / "run" / "checkpoints" / "step_00000004"
    deadline = time.monotonic() + 300
    while not checkpoint.exists() and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    first.send_signal(signal.SIGKILL)
    first.wait()
    assert json.loads((tmp_path / "run" / LOCK).read_text())["pid"] == first.pid
    resumed = run_pretrain(overrides)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"took over the lock of pid {first.pid}" in resumed.stderr
    assert "resumed from" in resumed.stderr
    assert not (tmp_path / "run" / LOCK).exists()
