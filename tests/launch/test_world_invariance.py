"""A run's result does not depend on how many ranks computed it (``docs/training.md``,
"Any world, the same run"). In float64, the small CNN with batch norm, a global batch of 48
in 3 chunks of 16: a run SIGKILLed and resumed on 2 -> 1 -> 3 ranks with 2 -> 1 -> 3 loader
workers a rank ends at the weights of the uninterrupted 2-rank run (to 1e-9 relative,
batch-norm statistics included), with its loss at every step and, step by step, the same
samples in its ledger. With ``data.global_batch=per_rank`` the batches follow the world,
and the run keeps what that mode promises: every sample once an epoch, and the learning
rate a function of the samples trained on. A world with more ranks than chunks is refused
before anything is trained. The same through two elastic torchrun agents, a node lost and
regained: ``test_multinode.py``."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from data_pipeline.loader.ledger import committed_steps, read_attempts
from tests.app.helpers import REPO, pretrain_command, run_pretrain, sigkill, train_overrides
from tests.launch.runs import assert_same_run, step_rows, steps_keys

pytestmark = pytest.mark.long_file  # collected first: tests/conftest.py

EXACT = {"train.precision": "fp64", "data.batch_size": 16, "data.global_batch_size": 48,
         "train.epochs": 3, "checkpoint.every": 2, "checkpoint.keep": 20,
         "data.ledger": True, "train.log_every": 1}
STEPS = 3 * (360 // 48)  # 360 digits, 7 global batches an epoch


def killed_after(overrides: list[str], nproc: int, run: Path, step: int) -> int:
    """Start the run on ``nproc`` ranks (torchrun) and SIGKILL every process of it once a
    checkpoint of ``step`` or later exists; the newest checkpoint's step."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    log = open(run.parent / f"killed-{nproc}.log", "w")
    agent = subprocess.Popen(pretrain_command(overrides, nproc, torchrun=True), cwd=REPO,
                             env=env, stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True)
    checkpoints = run / "checkpoints"
    deadline = time.monotonic() + 300
    while agent.poll() is None and time.monotonic() < deadline:
        done = [int(p.name[5:]) for p in checkpoints.glob("step_*")
                if (p / "shared.pt").exists()]
        if done and max(done) >= step:
            break
        time.sleep(0.05)
    assert agent.poll() is None, (run.parent / f"killed-{nproc}.log").read_text()[-3000:]
    process = psutil.Process(agent.pid)
    killed = [process, *process.children(recursive=True)]
    sigkill(killed)
    agent.wait()
    # the init process reaps the orphaned ranks within seconds: until then rank 0's pid
    # still holds the run's lock (``pretrain/run/run_lock.py``)
    psutil.wait_procs(killed, timeout=30)
    assert not any(psutil.pid_exists(p.pid) for p in killed)
    return max(int(p.name[5:]) for p in checkpoints.glob("step_*"))


def test_a_run_killed_on_two_one_and_three_ranks_ends_where_the_uninterrupted_run_does(
        digits_shards, uninterrupted, tmp_path):
    reference = uninterrupted(2, **EXACT)
    assert "encoded in pieces of at most 32 rows" in (reference / "train.log").read_text()
    run = tmp_path / "run"

    def overrides(workers: int) -> list[str]:
        return train_overrides(digits_shards, tmp_path, **EXACT, **{"data.workers": workers})

    two = killed_after(overrides(2), 2, run, step=4)
    one = killed_after(overrides(1), 1, run, step=two + 4)
    assert 4 <= two < one < STEPS
    three = run_pretrain(overrides(3), nproc=3, timeout=600)
    assert three.returncode == 0, three.stderr[-3000:]
    assert "written by 1 ranks, resumed on 3" in three.stderr
    assert "global batch 48 on 3 rank(s): 1 chunk(s) of 16 instances a rank, encoded at " \
           "once" in three.stderr
    log = (run / "train.log").read_text()
    assert "written by 2 ranks, resumed on 1" in log
    assert "global batch 48 on 1 rank(s): 3 chunk(s)" in log
    assert_same_run(reference, run, STEPS)


def test_more_ranks_than_chunks_are_refused_before_training(digits_shards, tmp_path):
    result = run_pretrain(train_overrides(digits_shards, tmp_path,
                                          **{"data.global_batch_size": 32, "train.max_steps": 1}),
                          nproc=3)
    assert result.returncode != 0
    assert ("the run's global batch of 32 (recorded in its checkpoints) is 2 chunk(s) of "
            "data.batch_size=16, and 3 ranks need a chunk each") in result.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()


PER_RANK = {"data.global_batch": "per_rank", "train.epochs": 2, "checkpoint.every": 2,
            "checkpoint.keep": 20, "data.ledger": True, "train.log_every": 1,
            "data.workers": 1, "optim.warmup_steps": 0}


def lr_by_samples(run: Path) -> dict[int, float]:
    """The learning rate of each step (as logged) over its global batch (the ledger's keys
    of the step: the linear scaling rule's lr is proportional to it), by the samples
    trained before the step (the ledger's keys again)."""
    rows = step_rows((run / "train.log").read_text())
    keys = steps_keys(run)
    out, before = {}, 0
    for step in sorted(keys):
        out[before] = rows[step][-1]["lr"] / len(keys[step])
        before += len(keys[step])
    return out


def test_per_rank_batches_follow_the_world_and_keep_the_epochs_and_the_schedule(
        digits_shards, uninterrupted, tmp_path):
    """2 ranks x 16 (a global batch of 32), killed, resumed on 1 rank x 16: the batches
    halve, each epoch still trains on every sample once (less than a global batch left
    unread), and the schedule is one curve in samples: at every sample count both runs
    reach, the learning rate per instance of the step's global batch is the uninterrupted
    run's (no warm-up: its length is set in steps)."""
    reference = uninterrupted(2, **PER_RANK)
    run = tmp_path / "run"
    overrides = train_overrides(digits_shards, tmp_path, **PER_RANK)
    killed = killed_after(overrides, 2, run, step=4)
    one = run_pretrain(overrides, nproc=1)
    assert one.returncode == 0, one.stderr[-3000:]
    assert f"at step {killed}" in one.stderr
    keys = steps_keys(run)
    assert {len(keys[s]) for s in keys if s <= killed} == {32}
    assert {len(keys[s]) for s in keys if s > killed} == {16}
    for epoch in range(2):
        trained = [k for line in committed_steps(read_attempts(run))
                   if line["epoch"] == epoch for k in line["keys"]]
        assert len(trained) == len(set(trained)) and 360 - len(trained) < 32, epoch
    ours, theirs = lr_by_samples(run), lr_by_samples(reference)
    common = sorted(set(ours) & set(theirs))
    assert len(common) >= len(theirs) - 1 and common[-1] > 352  # into the second epoch
    for samples in common:  # the logged lr has 4 significant digits
        assert ours[samples] == pytest.approx(theirs[samples], rel=1e-3), samples
