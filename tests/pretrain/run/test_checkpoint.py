"""Checkpoints: atomic, pruned, weights_only-loadable, corrupt-file fallback, and a run
killed with SIGKILL that resumes to exactly the weights of an uninterrupted run."""

from __future__ import annotations

import errno
import io
import json
import logging
import os
import signal
import subprocess
import time
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch

from core.config import ConfigError, load_config
from core.errors import RunError
from pretrain.run import checkpoint
from pretrain.run.checkpoint import (
    CheckpointConfig,
    Checkpointer,
    list_checkpoints,
    model_state_of,
    rng_state,
    set_rng_state,
)
from tests import prewarmed
from tests.app.helpers import REPO, pretrain_command, run_pretrain, train_overrides
from tests.data_pipeline.helpers import assert_ledger_by_keys

pytestmark = pytest.mark.long_file  # collected first: tests/conftest.py


def saved(step: int) -> tuple[dict, dict]:
    return ({"step": step, "world": 1, "model": {"w": torch.full((3,), float(step))},
             "optimizer": {"state": {}, "param_groups": []}},
            {"rng": rng_state(), "loader": {"epoch": 0, "batches": step}})


def test_save_keeps_the_newest_k_in_weights_only_files(tmp_path):
    ckpt = Checkpointer(tmp_path, CheckpointConfig(every=2, keep=2), 0, 1, torch.device("cpu"))
    for step in (2, 4, 6):
        ckpt.save(step, *saved(step))
    names = [p.name for p in ckpt.checkpoints()]
    assert names == ["step_00000006", "step_00000004"]
    assert not list((tmp_path / "checkpoints").glob(".*"))  # no temporary left behind
    for file in (tmp_path / "checkpoints" / "step_00000006").iterdir():
        torch.load(file, weights_only=True)
    shared, own, path = ckpt.load()
    assert shared["step"] == 6 and own["loader"]["batches"] == 6


class SigintOnSecondWrite(io.FileIO):
    """A file that delivers a real SIGINT to this process while torch.save writes to it."""

    writes = 0

    def write(self, data) -> int:
        SigintOnSecondWrite.writes += 1
        if SigintOnSecondWrite.writes == 2:
            signal.raise_signal(signal.SIGINT)
        return super().write(data)


def test_ctrl_c_while_a_checkpoint_is_written_is_an_interrupt_not_a_failed_write(
        tmp_path, monkeypatch, ctrl_c_raises):
    ckpt = Checkpointer(tmp_path, CheckpointConfig(every=2, keep=2), 0, 1, torch.device("cpu"))
    ckpt.save(2, *saved(2))

    def save_with_sigint(obj, path):
        with SigintOnSecondWrite(path, "wb") as f:
            torch.save(obj, f)

    monkeypatch.setattr(checkpoint, "_save", save_with_sigint)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save(4, *saved(4))
    assert [p.name for p in ckpt.checkpoints()] == ["step_00000002"]


def save_where_rank_1_meets_a_full_disk(root: str, background: bool = False) -> str:
    """Rank task: a checkpoint at step 2, then one at step 4 whose rank-1 file meets a full
    disk; what each rank's save of step 4 raised. ``background``: the sharded state is
    written in the background (``checkpoint.async_save``), its write succeeding."""
    import torch.distributed as dist

    from pretrain.run import checkpoint

    rank = dist.get_rank()
    cfg = CheckpointConfig(format="sharded", async_save=True) if background else \
        CheckpointConfig()
    ckpt = Checkpointer(Path(root), cfg, rank, 2, torch.device("cpu"))
    ckpt.save(2, *saved(2))
    written: Future = Future()
    written.set_result(None)
    real = checkpoint._save

    def full_on_rank_1(obj: dict, path: Path) -> None:
        if rank == 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        real(obj, path)

    checkpoint._save = full_on_rank_1
    try:
        ckpt.save(4, *saved(4), write_state=(lambda directory: written) if background else None)
        ckpt.finish()
    except RunError as err:
        return str(err)
    finally:
        checkpoint._save = real
    return "saved"


@pytest.mark.parametrize("background", [False, True], ids=["sync", "async"])
def test_a_rank_that_cannot_write_stops_every_rank_and_keeps_the_last(gloo2, tmp_path,
                                                                      background):
    """With the state written in the background too: the rank whose own file failed and
    the rank whose files were written agree at the save, so neither trains on alone."""
    told = gloo2.run(save_where_rank_1_meets_a_full_disk, str(tmp_path), background)
    partial = tmp_path / "checkpoints" / ".step_00000004.tmp"
    kept = ("the partial checkpoint was removed, every complete one is kept and the same "
            "command resumes from the newest")
    assert told[0] == (f"another rank could not write its part of checkpoint {partial} (its "
                       f"log line names why); {kept}")
    assert told[1].startswith(f"no space left on device writing checkpoint {partial} ("), \
        "\n".join(told)
    assert told[1].endswith(f": free space there or set output_dir to another disk; {kept}")
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000002"]
    assert not partial.exists()


def test_a_background_write_completes_its_checkpoint_only_once_it_has_finished(tmp_path):
    """``checkpoint.async_save``: the checkpoint is not listed (not resumable) while its
    state is being written; :meth:`Checkpointer.finish`, or the next save, completes it."""
    cfg = CheckpointConfig(keep=5, format="sharded", async_save=True)
    ckpt = Checkpointer(tmp_path, cfg, 0, 1, torch.device("cpu"))
    writes: list[Future] = []

    def write_in_background(directory: Path) -> Future:
        directory.mkdir()
        writes.append(Future())
        return writes[-1]

    ckpt.save(2, *saved(2), write_state=write_in_background)
    assert ckpt.checkpoints() == []  # still being written
    writes[-1].set_result(None)
    ckpt.save(4, *saved(4), write_state=write_in_background)  # completes step 2 first
    assert [p.name for p in ckpt.checkpoints()] == ["step_00000002"]
    writes[-1].set_result(None)
    ckpt.finish()
    assert [p.name for p in ckpt.checkpoints()] == ["step_00000004", "step_00000002"]
    ckpt.finish()  # nothing pending: nothing to do


def test_a_background_write_that_fails_removes_its_checkpoint_and_keeps_the_last(tmp_path):
    cfg = CheckpointConfig(format="sharded", async_save=True)
    ckpt = Checkpointer(tmp_path, cfg, 0, 1, torch.device("cpu"))
    ckpt.save(2, *saved(2))
    failed: Future = Future()
    failed.set_exception(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "state/__0_0.distcp"))
    ckpt.save(4, *saved(4), write_state=lambda directory: failed)
    partial = tmp_path / "checkpoints" / ".step_00000004.tmp"
    with pytest.raises(RunError, match=f"no space left on device writing checkpoint {partial}"):
        ckpt.finish()
    assert [p.name for p in ckpt.checkpoints()] == ["step_00000002"]
    assert not partial.exists()


def test_async_save_needs_the_sharded_format():
    with pytest.raises(ConfigError, match="async_save.*needs checkpoint.format=sharded"):
        load_config(CheckpointConfig, overrides=["async_save=true"])
    load_config(CheckpointConfig, overrides=["async_save=true", "format=sharded"])


def test_corrupt_newest_checkpoint_falls_back_to_the_previous(tmp_path, caplog):
    ckpt = Checkpointer(tmp_path, CheckpointConfig(keep=3), 0, 1, torch.device("cpu"))
    for step in (1, 2, 3):
        ckpt.save(step, *saved(step))
    newest = tmp_path / "checkpoints" / "step_00000003" / "shared.pt"
    newest.write_bytes(newest.read_bytes()[:100])  # truncated
    (tmp_path / "checkpoints" / ".step_00000004.tmp").mkdir()  # an interrupted write
    with caplog.at_level(logging.WARNING):
        shared, _, path = ckpt.load()
    assert shared["step"] == 2 and path.name == "step_00000002"
    assert "step_00000003 is unreadable" in caplog.text


def test_rng_state_round_trip():
    state = rng_state()
    first = (torch.rand(3), __import__("random").random(), __import__("numpy").random.rand())
    set_rng_state(state)
    again = (torch.rand(3), __import__("random").random(), __import__("numpy").random.rand())
    assert torch.equal(first[0], again[0]) and first[1:] == again[1:]


def final_model(run_dir) -> dict:
    """The newest checkpoint's shared.pt, its model state read whole when sharded."""
    last = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    shared, model = model_state_of(last)
    return {**shared, "model": model}


def test_sigkill_and_resume_equals_uninterrupted_run(digits_shards, tmp_path):
    steps = "train.max_steps=30"
    reference = train_overrides(digits_shards, tmp_path / "a", **{"checkpoint.every": 4})
    result = run_pretrain([*reference, steps])
    assert result.returncode == 0, result.stderr[-3000:]

    overrides = [*train_overrides(digits_shards, tmp_path / "b", **{"checkpoint.every": 4}),
                 steps]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(pretrain_command(overrides), cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    first = tmp_path / "b" / "run" / "checkpoints" / "step_00000008"
    deadline = time.monotonic() + 300
    while not first.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert proc.poll() is None, "the run ended before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    killed_at = max(int(p.name[5:]) for p in first.parent.glob("step_*"))
    assert killed_at < 30
    result = run_pretrain(overrides)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"at step {killed_at}" in result.stderr

    a, b = final_model(tmp_path / "a" / "run"), final_model(tmp_path / "b" / "run")
    assert a["step"] == b["step"] == 30
    for key, value in a["model"].items():
        assert torch.equal(value, b["model"][key]), key
    for key, value in a["optimizer"]["state"].items():
        assert torch.equal(value["velocity"], b["optimizer"]["state"][key]["velocity"])


def test_torchrun_restarts_a_killed_worker_and_resumes(digits_shards, uninterrupted, tmp_path):
    """2 DDP ranks under torchrun --max-restarts 1: SIGKILL one worker mid-run; torchrun
    restarts the group, which resumes from the newest checkpoint and ends with the weights
    of an uninterrupted 2-rank run. The killed run keeps an epoch ledger (the reference
    does not: the ledger changes nothing of the training), which shows every sample of
    each full epoch trained on exactly once, the 8 that do not fill a global batch of 32
    unread."""
    import psutil

    common = {"checkpoint.every": 4, "data.workers": 1, "train.max_steps": 24}
    reference = uninterrupted(2, **common)

    overrides = train_overrides(digits_shards, tmp_path / "b", **common, **{"data.ledger": True})
    command = pretrain_command(overrides, nproc=2)
    command.insert(command.index("--standalone"), "--max-restarts=1")
    log = open(tmp_path / "b.log", "w")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    first = tmp_path / "b" / "run" / "checkpoints" / "step_00000008"
    deadline = time.monotonic() + 300
    while not first.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    workers = [p for p in psutil.Process(proc.pid).children()
               if "app.pretrain" in " ".join(p.cmdline())]
    assert proc.poll() is None and len(workers) == 2
    workers[1].send_signal(signal.SIGKILL)
    assert proc.wait(timeout=300) == 0
    text = (tmp_path / "b.log").read_text()
    assert "resumed from" in text

    a, b = final_model(reference), final_model(tmp_path / "b" / "run")
    assert a["step"] == b["step"] == 24
    for key, value in a["model"].items():
        assert torch.equal(value, b["model"][key]), key
    ledger_dir = tmp_path / "b" / "run" / "ledger"
    ledgers = sorted(p.name.split("-rank")[0] for p in ledger_dir.iterdir())
    assert len(ledgers) == 4 and len(set(ledgers)) == 2  # two attempts of 2 ranks
    assert ledgers[2].endswith("-r001")  # torchrun's first restart
    counted = prewarmed.run_module("data_pipeline.loader.ledger",
                                   [str(tmp_path / "b" / "run"), "--json", "--keys"],
                                   dict(os.environ), timeout=120)
    assert counted.returncode == 0, counted.stderr
    epochs = json.loads(counted.stdout)["epochs"]
    figures = ("once", "more_than_once", "unread", "skipped", "unknown")
    assert {e: [c[k] for k in figures] for e, c in epochs.items()} == {  # 11 steps an epoch
        "0": [352, 0, 8, 0, 0], "1": [352, 0, 8, 0, 0], "2": [64, 0, 296, 0, 0]}
    assert_ledger_by_keys(epochs, tmp_path / "b" / "run", digits_shards, full=2)


def test_resuming_another_model_fails_in_one_line_naming_the_changed_keys(digits_shards,
                                                                          tmp_path):
    import mlflow

    first = train_overrides(digits_shards, tmp_path, **{"model.width": 16,
                                                        "train.max_steps": 4,
                                                        "tracking.enabled": True,
                                                        "tracking.log_model": False})
    assert run_pretrain(first).returncode == 0
    run_dir = tmp_path / "run"
    checkpoint = run_dir / "checkpoints" / "step_00000004"
    before = {p.name: p.read_bytes() for p in checkpoint.iterdir()}
    again = run_pretrain([*first, "model.width=32", "train.max_steps=8",
                          "checkpoint.allow_changes=[model.width]"])  # past the drift check
    assert again.returncode == 1
    assert "Traceback" not in again.stderr
    line = again.stderr.strip().splitlines()[-1]
    assert line.startswith(f"pretrain: error: {checkpoint}: its tensors do not fit the "
                           "configured model (size mismatch for "), line
    assert "model.width=16 in the checkpoint, 32 here" in line
    assert "train.max_steps" not in line  # only what shapes the tensors is named
    assert {p.name: p.read_bytes() for p in checkpoint.iterdir()} == before  # kept
    client = mlflow.MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    run = client.get_run((run_dir / "mlflow_run_id").read_text().strip())
    assert run.info.status == "FAILED", again.stderr[-3000:]
    # MLflow keeps a param's first value: the change is a tag, and the store stays in use
    assert run.data.tags["changed.model.width"] == "16 -> 32"
    assert run.data.params["model.width"] == "16"


def test_a_resume_that_changes_what_is_trained_is_refused_unless_allowed(digits_shards,
                                                                         tmp_path):
    first = train_overrides(digits_shards, tmp_path, **{"train.max_steps": 4})
    assert run_pretrain(first).returncode == 0
    checkpoint = tmp_path / "run" / "checkpoints" / "step_00000004"
    refused = run_pretrain([*first, "objective.temperature=0.2", "train.max_steps=6"])
    assert refused.returncode == 1 and "Traceback" not in refused.stderr
    assert refused.stderr.strip().splitlines()[-1] == (
        f"pretrain: error: {checkpoint}: resuming would change what is trained "
        "(objective.temperature=0.1 in the checkpoint, 0.2 here): resume with the "
        "checkpoint's values, allow the change with "
        "checkpoint.allow_changes=[objective.temperature], or choose another name or "
        "output_dir (the checkpoint is kept)")
    assert [p.name for p in checkpoint.parent.iterdir()] == ["step_00000004"]

    # a benign change (learning rate, steps, workers) goes on with one warning
    benign = run_pretrain([*first, "optim.lr=0.01", "train.max_steps=6", "data.workers=1"])
    assert benign.returncode == 0, benign.stderr[-3000:]
    warning = next(line for line in benign.stderr.splitlines() if "changed keys" in line)
    assert "data.workers: 2 -> 1" in warning and "train.max_steps: 4 -> 6" in warning
    assert "optim.lr: " in warning

    allowed = run_pretrain([*first, "objective.temperature=0.2", "train.max_steps=8",
                            "checkpoint.allow_changes=[objective.]"])
    assert allowed.returncode == 0, allowed.stderr[-3000:]
    assert "resumed from" in allowed.stderr
