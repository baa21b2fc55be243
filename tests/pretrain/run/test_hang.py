"""The hang watch's parts (``pretrain/run/hang.py``, ``pretrain/run/step_timer.py``) against
real processes, a real store and a real MLflow store; the whole under two torchrun agents:
``tests/launch/test_hang.py``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from datetime import timedelta
from pathlib import Path

import mlflow
import psutil
import pytest
import torch.distributed as dist

from pretrain.run.hang import (
    BEAT_S,
    HangConfig,
    HangWatch,
    Heartbeat,
    report_hangs,
    who_stopped,
)
from pretrain.run.tracking import Tracker, TrackingConfig
from tests.app.helpers import REPO
from tests.ports import free_port

CLIENT = textwrap.dedent("""
    import multiprocessing, os, sys, time
    from torch.distributed.elastic.timer import FileTimerClient
    child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,))
    child.start()
    print(child.pid, flush=True)
    FileTimerClient(sys.argv[1]).acquire("rank 3", time.time() + float(sys.argv[2]))
    time.sleep(60)
""")


def start_server(pipe: Path) -> subprocess.Popen:
    server = subprocess.Popen([sys.executable, "-m", "pretrain.run.step_timer", str(pipe)],
                              cwd=REPO, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not pipe.exists():
        assert time.monotonic() < deadline and server.poll() is None
        time.sleep(0.05)
    return server


def test_the_step_timer_kills_a_stopped_process_with_its_group_and_stays_up(tmp_path):
    """A frozen process (SIGSTOP) whose timer expires is killed with its child (its own
    process group, as torchrun starts a worker); the server lives on to kill the next."""
    server = start_server(tmp_path / "pipe")
    try:
        for _ in range(2):
            worker = subprocess.Popen([sys.executable, "-c", CLIENT, str(tmp_path / "pipe"),
                                       "1.5"], stdout=subprocess.PIPE, text=True,
                                      start_new_session=True)
            child = psutil.Process(int(worker.stdout.readline()))
            time.sleep(0.5)
            worker.send_signal(signal.SIGSTOP)
            assert worker.wait(timeout=10) == -signal.SIGKILL
            child.wait(timeout=10)
            assert server.poll() is None
    finally:
        server.terminate()  # ignored: it ends with its parent (this test's process)
        server.kill()
        _, err = server.communicate(timeout=10)
    assert err.count("step timer: rank 3 (pid") == 2, err


MOVING = textwrap.dedent("""
    import sys, time
    from torch.distributed.elastic.timer import FileTimerClient
    client = FileTimerClient(sys.argv[1])
    for _ in range(8):  # 4 s of steps of 0.5 s, each moving a 1 s timer on
        client.acquire("rank 0", time.time() + 1.0)
        time.sleep(0.5)
    client.release("rank 0")
""")


def test_a_timer_moved_on_in_time_kills_nothing(tmp_path):
    server = start_server(tmp_path / "pipe")
    try:
        worker = subprocess.run([sys.executable, "-c", MOVING, str(tmp_path / "pipe")],
                                timeout=60, start_new_session=True)
        assert worker.returncode == 0
    finally:
        server.kill()


def test_the_waiting_rank_names_a_frozen_rank_and_one_waiting_for_its_data():
    shared = dist.HashStore()
    beats = [Heartbeat(shared, rank) for rank in range(4)]
    for rank in (0, 1):
        beats[rank].phase = "step"  # in the step's collectives
    beats[3].close()  # frozen: its count stops
    time.sleep(2 * BEAT_S)
    line = who_stopped(shared, 4, 0, 12, 15.2)
    assert "waited 15 s" in line
    for beat in beats:
        beat.close()
    assert line.startswith("hang at step 12: rank 0 waited 15 s in a collective for rank 3 "
                           f"on {beats[3].host} (pid {os.getpid()}, no heartbeat), rank 2 on ")
    assert "(pid" in line and "waiting for its data" in line and "rank 1" not in line


def test_a_store_that_stops_answering_names_rank_0():
    """The store served in a process that is then frozen (as rank 0 serves it under the
    elastic launch): the waiting rank's reads fail after the client's timeout."""
    port = free_port()
    served = subprocess.Popen([sys.executable, "-c", "import time; from torch.distributed "
                               f"import TCPStore; s = TCPStore('127.0.0.1', {port}, None, "
                               "True, wait_for_workers=False); time.sleep(600)"])
    try:
        client = dist.TCPStore("127.0.0.1", port, None, is_master=False,
                               timeout=timedelta(seconds=60))  # while the server starts
        client.set_timeout(timedelta(seconds=1))
        beats = [Heartbeat(client, rank) for rank in range(2)]
        beats[0].phase = "step"
        assert "for a rank that went on again (every heartbeat moved" in \
            who_stopped(client, 2, 1, 5, 15)
        served.send_signal(signal.SIGSTOP)
        line = who_stopped(client, 2, 1, 5, 15)
        for beat in beats:
            beat.close()
    finally:
        served.kill()
    assert line == ("hang at step 5: rank 1 waited 15 s in a collective and the job's store "
                    "(served on rank 0's node) does not answer: rank 0 or its node stopped")


def test_the_timeout_follows_the_median_step_after_warmup(tmp_path, monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    watch = HangWatch(HangConfig(warmup_steps=3, floor_s=5, factor=10), 0, 1, 600.0,
                      tmp_path, None)
    for step, seconds in enumerate([0.2, 3.0, 0.2], start=1):
        assert watch.expiry_s == 600.0  # the first steps keep the long timeout
        clock[0] += seconds
        watch.progress(step)
    clock[0] += 0.3
    watch.progress(4)
    assert watch.expiry_s == 5.0  # 10 x a median of 0.25 s is under the floor
    for step in range(5, 12):
        clock[0] += 2.0
        watch.progress(step)
    assert watch.expiry_s == 20.0  # 10 x the median 2 s


def test_a_long_phase_follows_its_own_time_after_its_first_run(tmp_path, monkeypatch):
    """A checkpoint write waits the long timeout the first time, then 10 x its own median;
    a phase inside a longer one (the run's end around a write) keeps the longer."""
    clock = [0.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    watch = HangWatch(HangConfig(warmup_steps=2, floor_s=5, factor=10), 0, 1, 600.0,
                      tmp_path, None)
    for step in (1, 2):
        clock[0] += 1.0
        watch.progress(step)
    assert watch.expiry_s == 10.0
    for seconds, inside in ((3.0, 600.0), (4.0, 30.0), (5.0, 35.0)):
        with watch.long_phase("save"):
            assert watch.expiry_s == inside  # the long timeout, then 10 x the median
            clock[0] += seconds
        assert watch.expiry_s == 10.0  # steps again
    with watch.long_phase("end"), watch.long_phase("save"):
        assert watch.expiry_s == 600.0
    with watch.long_phase("knn"):
        assert watch.expiry_s == 600.0  # another phase: not timed yet


def test_a_restart_follows_the_recorded_times_from_its_third_step(tmp_path, monkeypatch):
    """Rank 0 records the run's median step every warmup_steps steps; a restart keeps the
    long timeout for its first two steps only, then follows the record (scaled up when the
    world shrank, never down; its own steps where they are slower) until it has measured
    its own; a checkpoint write's time is not a step's."""
    clock = [0.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    cfg = HangConfig(warmup_steps=4, floor_s=1, factor=10)
    first = HangWatch(cfg, 0, 3, 600.0, tmp_path, None)  # rank 0 of 3 ranks
    for step in range(1, 57):
        clock[0] += 0.5
        with first.long_phase("save"):  # inside the step, as the trainer writes
            clock[0] += 3.0
        first.progress(step)
    (tmp_path / "hangs" / "step_time.json").unlink()
    first.progress(57)
    assert not (tmp_path / "hangs" / "step_time.json").exists()  # every warmup_steps steps
    clock[0] += 0.5
    first.progress(58)
    first.progress(59)
    clock[0] += 0.5
    first.progress(60)  # recorded again: the median 0.5 s on 3 ranks
    for world, second, expiry in ((3, 0.5, 5.0), (1, 0.5, 15.0), (6, 0.1, 5.0), (3, 2.0, 20.0)):
        restarted = HangWatch(cfg, 1, world, 600.0, tmp_path, None)
        with restarted.long_phase("save"):
            assert restarted.expiry_s == 600.0  # a phase's first run in this process
        clock[0] += 8.0  # the restart's first step: the loader's start
        restarted.progress(1)
        assert restarted.expiry_s == 600.0
        clock[0] += second
        restarted.progress(2)
        assert restarted.expiry_s == pytest.approx(expiry)
    assert HangWatch(cfg, 1, 1, 600.0, tmp_path / "fresh", None).recorded_s is None
    for hostile in ('{"step_s": 1e999, "world": 3}', '{"step_s": 0.5, "world": 1e999}',
                    '{"step_s": -1, "world": 3}', '[' * 100000, '{"step_s": "x"}'):
        (tmp_path / "hangs" / "step_time.json").write_text(hostile)
        assert HangWatch(cfg, 1, 1, 600.0, tmp_path, None).recorded_s is None


def test_rank_0_says_whether_a_step_timer_serves_it(tmp_path, monkeypatch, caplog):
    monkeypatch.delenv("TORCHELASTIC_TIMER_FILE", raising=False)
    caplog.set_level("INFO", logger="pretrain.run.hang")
    HangWatch(HangConfig(), 0, 1, 600.0, tmp_path, None).close()
    assert "hang watch" not in caplog.text  # one process: no peer to wait for
    HangWatch(HangConfig(), 0, 2, 600.0, tmp_path, None).close()
    assert "hang watch: no step timer (launch/torchrun.sh" in caplog.text


def test_the_restarted_run_logs_each_hang_once_and_tags_it(tmp_path, caplog):
    folder = tmp_path / "hangs"
    folder.mkdir()
    for rank in (0, 2):  # two waiting ranks named the same hang
        (folder / f"1-rank{rank}.json").write_text(
            f'{{"step": 9, "rank": {rank}, "line": "hang at step 9: rank {rank} waited", '
            '"time": 1}\n')
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = Tracker(TrackingConfig(uri=uri, system_metrics=False), tmp_path, "run")
    tracker.start({})
    assert report_hangs(tmp_path, tracker) == 1
    assert report_hangs(tmp_path, tracker) == 0  # reported once
    tracker.finish()
    run = mlflow.MlflowClient(uri).get_run(tracker.run_id)
    assert run.data.tags["hang.1"] == "hang at step 9: rank 0 waited"
    assert run.data.metrics["hangs"] == 1.0
    assert "restarted after a hang at step 9" in caplog.text
