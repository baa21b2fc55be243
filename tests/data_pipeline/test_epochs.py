"""Persistent loader workers: the same batches as a loader made per epoch, exact resume,
workers that outlive an epoch, a process that exits while they still run, and a Ctrl-C
that waits for the batch on its way."""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys

import pytest
import torch

from data_pipeline.loader import LoaderState, TrainLoader, train_batches
from data_pipeline.loader.epochs import arriving_whole
from tests.app.helpers import REPO
from tests.data_pipeline.test_loader import config, planted_set

EPOCHS = 3


def epochs_per_loader(cfg, state: LoaderState, epochs: int) -> list[list[dict]]:
    """The reference: a fresh single-epoch loader for every epoch."""
    return [list(train_batches(cfg, state=state)) for _ in range(epochs)]


def assert_same(got: list[list[dict]], want: list[list[dict]]) -> None:
    assert [len(e) for e in got] == [len(e) for e in want]
    for got_epoch, want_epoch in zip(got, want, strict=True):
        for a, b in zip(got_epoch, want_epoch, strict=True):
            assert a["keys"] == b["keys"] and a["skipped"] == b["skipped"]
            assert torch.equal(a["images"], b["images"])


def test_persistent_workers_deliver_every_epoch_as_a_loader_per_epoch_does(tmp_path):
    planted_set(tmp_path)  # undecodable samples: skips must be counted in every epoch
    cfg = config(tmp_path, batch_size=4, shuffle_buffer=8)
    want_state, got_state = LoaderState(), LoaderState()
    want = epochs_per_loader(cfg, want_state, EPOCHS)
    loader = TrainLoader(cfg, state=got_state)
    got = [list(loader.epoch()) for _ in range(EPOCHS)]
    loader.close()
    assert_same(got, want)
    assert got_state == want_state and got_state.epoch == EPOCHS
    assert got[0][0]["keys"] != got[1][0]["keys"]  # the epochs differ


def test_the_workers_outlive_an_epoch(tmp_path):
    planted_set(tmp_path)
    loader = TrainLoader(config(tmp_path, batch_size=4))
    pids = []
    for _ in range(EPOCHS):
        for _batch in loader.epoch():
            pass
        pids.append(sorted(w.pid for w in loader.loader._iterator._workers))
    assert pids[0] == pids[1] == pids[2]
    single = TrainLoader(config(tmp_path, batch_size=4, persistent_workers=False))
    assert not single.persistent
    loader.close()


def test_a_persistent_loader_resumes_mid_epoch_exactly(tmp_path):
    planted_set(tmp_path)
    cfg = config(tmp_path, batch_size=4, shuffle_buffer=8)
    state = LoaderState()
    loader = TrainLoader(cfg, state=state)
    full, snapshot = [], None
    for epoch in range(EPOCHS):
        full.append([])
        for batch in loader.epoch():
            full[-1].append(batch)
            if epoch == 1 and state.batches == 2:
                snapshot = copy.deepcopy(state)
    loader.close()
    resumed = TrainLoader(cfg, state=snapshot)
    got = [list(resumed.epoch()) for _ in range(EPOCHS - 1)]
    resumed.close()
    assert_same(got, [full[1][2:], full[2]])


def test_an_unfinished_epoch_continues_from_the_state(tmp_path):
    """A consumer that stops taking batches mid-epoch ends the workers; the next epoch()
    call carries on where the state says, as a resumed run would."""
    planted_set(tmp_path)
    cfg = config(tmp_path, batch_size=4, shuffle_buffer=8)
    want = epochs_per_loader(cfg, LoaderState(), 2)
    state = LoaderState()
    loader = TrainLoader(cfg, state=state)
    head = []
    for batch in loader.epoch():
        head.append(batch)
        if len(head) == 3:
            break
    assert loader.loader is None and state.batches == 3
    rest = [list(loader.epoch()) for _ in range(2)]
    loader.close()
    assert_same([head + rest[0], rest[1]], want)


EXIT_WITH_LIVE_WORKERS = """
import sys
from torch.utils.data import DataLoader
from data_pipeline.loader.epochs import ignore_scheduler_signals
KEEP = []
if __name__ == "__main__":
    loader = DataLoader(range(8), batch_size=2, num_workers=2, persistent_workers=True,
                        worker_init_fn=ignore_scheduler_signals,
                        multiprocessing_context=sys.argv[1])
    next(iter(loader))
    KEEP.append(loader)  # still alive at exit, as a run's loader can be
    print("exiting", flush=True)
"""


@pytest.mark.parametrize("context", ["fork", "forkserver"])
def test_a_process_exits_with_its_loader_workers_still_alive(tmp_path, context):
    """Workers that ignore SIGTERM must not keep their process from exiting: at exit torch
    leaves them to multiprocessing, which sends SIGTERM and waits (forever, without
    end_workers_at_exit)."""
    script = tmp_path / "exit_with_workers.py"
    script.write_text(EXIT_WITH_LIVE_WORKERS)
    done = subprocess.run([sys.executable, str(script), context], cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "exiting"
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr, \
        done.stderr[-3000:]


def interrupting(presses: int, delivered: list[int]):
    """Batches whose arrival is interrupted by ``presses`` Ctrl-Cs, as a terminal sends
    them while the main process receives a batch from a worker."""
    for index in range(3):
        for _ in range(presses if index == 1 else 0):
            signal.raise_signal(signal.SIGINT)
        delivered.append(index)  # the whole batch has arrived
        yield {"index": index}


def test_a_ctrl_c_while_a_batch_arrives_is_raised_once_it_has_arrived(ctrl_c_raises):
    delivered: list[int] = []
    batches = arriving_whole(interrupting(1, delivered))
    assert next(batches) == {"index": 0}
    with pytest.raises(KeyboardInterrupt):
        next(batches)
    assert delivered == [0, 1]  # received whole, then raised
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_second_ctrl_c_is_raised_at_once(ctrl_c_raises):
    delivered: list[int] = []
    batches = arriving_whole(interrupting(2, delivered))
    next(batches)
    with pytest.raises(KeyboardInterrupt):
        next(batches)
    assert delivered == [0]  # the arrival itself was interrupted
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_where_ctrl_c_is_ignored_it_stays_ignored():
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        delivered: list[int] = []
        assert [b["index"] for b in arriving_whole(interrupting(1, delivered))] == [0, 1, 2]
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)
