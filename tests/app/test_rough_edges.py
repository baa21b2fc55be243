"""Two rough edges of a run: a batch in which every sample was skipped (the ranks step over
it together, counted, with no NaN in any statistic), and Ctrl-C (one line with the step,
the newest checkpoint and the command that resumes; the MLflow run marked FAILED)."""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import time

import pytest

from data_pipeline.config import DataConfig
from data_pipeline.formats import Sample
from data_pipeline.loader import train_batches
from data_pipeline.loader.state import LoaderState
from tests.app.helpers import REPO, pretrain_command, run_pretrain, train_overrides
from tests.data_pipeline.helpers import digit_sample, write_set
from tests.scratch import scratch_dir

BAD = 60


@pytest.fixture(scope="module")
def holey_shards(tmp_path_factory):
    """A shard of good digits, a shard of 60 undecodable JPEGs, another good one: read with
    one lane, batches of 2 fall wholly inside the bad shard."""
    bad = [Sample(f"bad{i:04d}", b"\xff\xd8 not a jpeg", "jpg", i % 10, "a caption")
           for i in range(BAD)]
    with scratch_dir(tmp_path_factory, "holey") as root:
        write_set(root / "shards", [[digit_sample(i) for i in range(40)], bad,
                                    [digit_sample(i) for i in range(40, 80)]])
        yield root / "shards"


def test_a_batch_of_skipped_samples_is_a_placeholder_and_the_epoch_keeps_its_length(
        holey_shards):
    cfg = DataConfig(shards=str(holey_shards), batch_size=2, workers=0, resolution=16,
                     lanes=1, shuffle_buffer=4, max_skip_fraction=1.0)
    state = LoaderState()
    batches = list(train_batches(cfg, state=state))
    assert len(batches) == (40 + BAD + 40) // 2  # one per position, skipped or not
    placeholders = [b for b in batches if b["placeholder"]]
    assert len(placeholders) >= 10
    assert all(b["images"].shape == (2, 3, 16, 16) and not b["keys"] for b in placeholders)
    assert state.skipped == {"corrupt_image": BAD}
    assert sum(b["skipped"].get("corrupt_image", 0) for b in batches) == BAD


def logged_rows(stderr: str) -> list[dict[str, float]]:
    rows = []
    for line in stderr.splitlines():
        found = re.search(r"step \d+ ((?:[\w./]+=\S+ ?)+)$", line)
        if found:
            rows.append({k: float(v) for k, v in (kv.split("=") for kv in found[1].split())})
    return rows


@pytest.mark.parametrize("nproc", [1, 2])
def test_the_ranks_step_over_an_empty_batch_together_without_nan(holey_shards, tmp_path,
                                                                 nproc):
    result = run_pretrain(train_overrides(holey_shards, tmp_path, **{
        "data.batch_size": 2, "data.lanes": 1, "data.shuffle_buffer": 4,
        "data.max_skip_fraction": 1.0, "data.workers": 1, "train.epochs": 1,
        "train.log_every": 5, "objective.name": "supcon"}), nproc=nproc, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "had a rank whose every sample was skipped; no update in them" in result.stderr
    rows = logged_rows(result.stderr)
    assert rows and sum(r["empty_steps"] for r in rows) >= 1
    assert all(math.isfinite(v) for r in rows for v in r.values()), rows
    assert f"'corrupt_image': {BAD}" in result.stderr  # every skip counted over the ranks


def default_sigint() -> None:
    """The run's Ctrl-C as a terminal gives it, whatever launched pytest: a shell starts a
    background job (``cmd &``, ``nohup``) with SIGINT ignored, which its children inherit
    and Python then leaves ignored."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_ends_the_run_in_one_line_naming_step_checkpoint_and_resume(digits_shards,
                                                                          tmp_path):
    overrides = train_overrides(digits_shards, tmp_path, **{
        "train.epochs": 50, "checkpoint.every": 2, "tracking.enabled": True,
        "tracking.system_metrics": False, "data.workers": 1})
    process = subprocess.Popen(pretrain_command(overrides), cwd=REPO, text=True,
                               stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                               env={**os.environ, "HF_HUB_OFFLINE": "1"},
                               start_new_session=True, preexec_fn=default_sigint)
    checkpoints = tmp_path / "run" / "checkpoints"
    deadline = time.monotonic() + 240
    while not (checkpoints.is_dir() and any(checkpoints.glob("step_*"))):
        assert process.poll() is None and time.monotonic() < deadline
        time.sleep(0.2)
    os.killpg(process.pid, signal.SIGINT)  # as a terminal's Ctrl-C: the whole group
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr[-3000:]
    last = stderr.strip().splitlines()[-1]
    found = re.fullmatch(r"pretrain: interrupted at step (\d+); newest checkpoint (\S+); the "
                         r"same command resumes it: (.+)", last)
    assert found, last
    assert found[2].startswith(str(checkpoints)) and os.path.isdir(found[2])
    assert "pretrain" in found[3] and f"output_dir={tmp_path}" in found[3]

    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'run' / 'mlflow.db'}")
    runs = client.search_runs(client.get_experiment_by_name("contrastive-pretraining")
                              .experiment_id)
    assert [r.info.status for r in runs] == ["FAILED"], stderr[-6000:]
