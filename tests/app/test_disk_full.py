"""A full disk is one line naming what could not be written and the key that places it,
exit status 1, every checkpoint kept, the MLflow run FAILED where its store can still be
written, and the same command resumes once there is space. Real file systems: a small
tmpfs (:mod:`tests.small_disk`) for the checkpoints, the tracking store or the evaluation's
output, real SQLite MLflow stores."""

from __future__ import annotations

import errno
import logging
import os
import subprocess
import time

import mlflow
import pytest
import torch

from core.errors import RunError
from pretrain.run.checkpoint import list_checkpoints
from pretrain.run.run_log import RunLogFile
from pretrain.run.tracking import RUN_ID_FILE, Tracker, TrackingConfig
from tests import prewarmed
from tests.app.helpers import REPO, pretrain_command, run_pretrain, train_overrides
from tests.scratch import scratch_dir
from tests.small_disk import resize, small_disk

COMMON = {"train.max_steps": 8, "checkpoint.every": 4, "data.workers": 1,
          "tracking.enabled": True, "tracking.log_model": False,
          "tracking.system_metrics": False}


def size_of(path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def fill(path) -> None:
    """Write ``path`` until its disk is full."""
    with open(path, "wb", buffering=0) as filler:
        try:
            while True:
                filler.write(b"\0" * 4096)
        except OSError as err:
            assert err.errno == errno.ENOSPC, err


def store(uri: str, artifacts) -> mlflow.MlflowClient:
    """An SQLite store whose experiment keeps its artifacts under ``artifacts``."""
    client = mlflow.MlflowClient(uri)
    client.create_experiment("contrastive-pretraining", artifacts.as_uri())
    return client


def run_status(client: mlflow.MlflowClient, run_dir) -> str:
    return client.get_run((run_dir / RUN_ID_FILE).read_text().strip()).info.status


def one_line_fault(result: subprocess.CompletedProcess, prog: str) -> str:
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith(f"{prog}: error: "), line
    return line


@pytest.fixture(scope="module")
def reference(digits_shards, tmp_path_factory):
    """An uninterrupted 8-step run with checkpoints at steps 4 and 8."""
    with scratch_dir(tmp_path_factory, "disk-full") as root:
        result = run_pretrain(train_overrides(digits_shards, root, **COMMON))
        assert result.returncode == 0, result.stderr[-3000:]
        yield root / "run"


def test_a_checkpoint_on_a_full_disk(digits_shards, reference, tmp_path):
    checkpoint = size_of(reference / "checkpoints" / "step_00000004")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = store(uri, tmp_path / "artifacts")
    overrides = train_overrides(digits_shards, tmp_path / "disk", **COMMON,
                                **{"tracking.uri": uri})
    run_dir = tmp_path / "disk" / "run"
    # room for the first checkpoint, the log and the journal; not for the second
    with small_disk(tmp_path / "disk", checkpoint + checkpoint // 2):
        full = run_pretrain(overrides)
        line = one_line_fault(full, "pretrain")
        tmp = run_dir / "checkpoints" / ".step_00000008.tmp"
        assert line.startswith(f"pretrain: error: no space left on device writing checkpoint "
                               f"{tmp} ("), line
        assert line.endswith(": free space there or set output_dir to another disk; the "
                             "partial checkpoint was removed, every complete one is kept and "
                             "the same command resumes from the newest"), line
        assert [p.name for p in list_checkpoints(run_dir)] == ["step_00000004"]
        assert not tmp.exists()
        assert run_status(client, run_dir) == "FAILED"

        resize(tmp_path / "disk", 4 * checkpoint)  # the user frees space
        resumed = run_pretrain(overrides)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert "resumed from" in resumed.stderr and "step_00000004" in resumed.stderr
        assert run_status(client, run_dir) == "FINISHED"
        mine = torch.load(run_dir / "checkpoints" / "step_00000008" / "shared.pt",
                          weights_only=True)
    theirs = torch.load(reference / "checkpoints" / "step_00000008" / "shared.pt",
                        weights_only=True)
    for key, value in theirs["model"].items():
        assert torch.equal(value, mine["model"][key]), key


def test_a_full_tracking_store(digits_shards, tmp_path):
    overrides = train_overrides(digits_shards, tmp_path, **{
        **COMMON, "train.max_steps": 400, "checkpoint.every": 10, "train.log_every": 1,
        "tracking.uri": f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}"})
    run_dir = tmp_path / "run"
    log = tmp_path / "pretrain.log"
    with small_disk(tmp_path / "store", 4 * 2**20) as disk:
        store(f"sqlite:///{disk / 'mlflow.db'}", tmp_path / "artifacts")
        with open(log, "w") as out:
            proc = subprocess.Popen(pretrain_command(overrides), cwd=REPO, stdout=out,
                                    stderr=subprocess.STDOUT)
            deadline = time.monotonic() + 300
            while not list_checkpoints(run_dir) and proc.poll() is None \
                    and time.monotonic() < deadline:
                time.sleep(0.05)
            fill(disk / "filler")  # the store's disk fills up while the run trains
            status = proc.wait(timeout=300)
        text = log.read_text()
        assert status == 1, text[-3000:]
        assert "Traceback" not in text, text[-3000:]
        line = text.strip().splitlines()[-1]
        assert line.startswith("pretrain: error: no space left on device writing to the "
                               f"MLflow tracking store sqlite:///{disk / 'mlflow.db'}"), line
        assert ": free space there or set tracking.uri to another disk; every checkpoint " \
               "written so far is kept" in line, line
        assert list_checkpoints(run_dir)  # kept
        step = max(int(p.name[5:]) for p in list_checkpoints(run_dir))
        (disk / "filler").unlink()  # the user frees space: the same command resumes
        resumed = run_pretrain([*overrides, "train.max_steps=" + str(step + 2)])
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        client = mlflow.MlflowClient(f"sqlite:///{disk / 'mlflow.db'}")
        run_id = (run_dir / RUN_ID_FILE).read_text().strip()
        steps = {m.step for m in client.get_metric_history(run_id, "loss")}
    assert set(range(1, step + 3)) <= steps  # nothing journaled was lost


def evaluate(reference, shards, out) -> subprocess.CompletedProcess:
    overrides = [f"output_dir={reference.parent}", "name=run", "data.resolution=16",
                 f"eval.train_shards={shards}", f"eval.test_shards={shards}",
                 "eval.probe_epochs=1", f"eval.output={out}"]
    return prewarmed.run_module("app.evaluate", overrides, dict(os.environ), timeout=600)


def evaluation_runs(reference) -> list[str]:
    """The statuses of the MLflow runs evaluating the reference run."""
    client = mlflow.MlflowClient(f"sqlite:///{reference / 'mlflow.db'}")
    training = client.get_run((reference / RUN_ID_FILE).read_text().strip())
    children = client.search_runs([training.info.experiment_id],
                                  f"tags.mlflow.parentRunId = '{training.info.run_id}'")
    return sorted(run.info.status for run in children)


def test_a_full_evaluation_output(reference, digits_shards, tmp_path):
    before = evaluation_runs(reference)
    with small_disk(tmp_path / "out", 16 * 1024) as out:
        result = evaluate(reference, digits_shards, out)
    line = one_line_fault(result, "evaluate")
    assert line.startswith(f"evaluate: error: no space left on device writing the "
                           f"evaluation's output {out} ("), line
    assert line.endswith(": free space there or set eval.output to another disk; the model "
                         "and its checkpoints are untouched and the same command evaluates "
                         "again"), line
    assert evaluation_runs(reference) == before  # no MLflow run for outputs never written
    assert not (out / "features").exists()  # the bank's files written before the disk filled


def test_a_full_artifact_store_fails_the_evaluation_run(reference, digits_shards, tmp_path):
    before = evaluation_runs(reference)
    with small_disk(reference / "mlartifacts", 16 * 1024):  # the store's artifacts fill up
        result = evaluate(reference, digits_shards, tmp_path / "out")
    line = one_line_fault(result, "evaluate")
    assert line.startswith("evaluate: error: no space left on device writing to the MLflow "
                           f"tracking store sqlite:///{reference / 'mlflow.db'}"), line
    assert "set tracking.uri to another disk" in line, line
    assert (tmp_path / "out" / "results.json").is_file()  # the outputs are written
    assert evaluation_runs(reference) == sorted([*before, "FAILED"])


def test_train_log_on_a_full_disk_stops_in_one_warning(tmp_path, capsys):
    with small_disk(tmp_path / "disk", 64 * 1024) as disk:
        handler = RunLogFile(disk / "train.log")
        logger = logging.getLogger("test_disk_full.train_log")
        logger.addHandler(handler)
        logger.propagate = False
        try:
            fill(disk / "filler")
            for i in range(200):  # past the file's buffer
                logger.warning("line %d %s", i, "x" * 100)
        finally:
            logger.removeHandler(handler)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"pretrain: warning: {disk / 'train.log'} is no longer written "
                          "(OSError: [Errno 28] No space left on device)"), err


def test_a_metric_journal_on_a_full_disk_names_it(tmp_path):
    with small_disk(tmp_path / "run", 64 * 1024) as run_dir:
        uri = f"sqlite:///{tmp_path / 'mlflow.db'}"  # the store is on another disk
        tracker = Tracker(TrackingConfig(uri=uri, system_metrics=False), run_dir, "run")
        fill(run_dir / "filler")
        with pytest.raises(RunError) as raised:
            for step in range(200):
                tracker.log_metrics(step, {"loss": 1.0, "padding": 2.0 * step})
    assert str(raised.value).startswith("no space left on device writing the metric journal "
                                        f"{run_dir / 'mlflow_pending.jsonl'} ("), raised.value
    assert "set output_dir to another disk" in str(raised.value)
