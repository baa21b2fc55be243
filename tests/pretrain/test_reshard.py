"""Resuming on another number of ranks: a checkpoint of 1 rank continues on 2 and one of 2
on 1 (DDP, the same global batch), against the uninterrupted run; sharded optimizer state
(ZeRO-2) is refused and kept; a run never starts over checkpoints it cannot resume."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import mlflow
import pytest
import torch

from tests.app.helpers import REPO, pretrain_command, run_pretrain, train_overrides
from tests.pretrain.test_checkpoint import final_model

STEPS = {"train.max_steps": 24, "checkpoint.every": 4, "checkpoint.keep": 10,
         "data.workers": 1}


def logged(stderr: str, key: str) -> dict[int, float]:
    """{step: value} of ``key`` in the training log's metric rows."""
    return {int(step): float(re.search(rf"\b{key}=(\S+)", row).group(1))
            for step, row in re.findall(r"INFO: step (\d+) (.*)", stderr)}


@pytest.fixture(scope="module")
def references(digits_shards, tmp_path_factory):
    """Uninterrupted runs at global batch 16: 1 rank x 16, 2 ranks x 8."""
    root = tmp_path_factory.mktemp("reshard")
    runs = {}
    for world in (1, 2):
        overrides = train_overrides(digits_shards, root / f"w{world}", **STEPS,
                                    **{"data.batch_size": 16 // world})
        result = run_pretrain(overrides, nproc=world)
        assert result.returncode == 0, result.stderr[-3000:]
        runs[world] = (root / f"w{world}" / "run", result.stderr)
    return runs


@pytest.mark.parametrize(("old", "new"), [(1, 2), (2, 1)])
def test_a_checkpoint_resumes_on_another_number_of_ranks(references, digits_shards, tmp_path,
                                                         old, new):
    source = references[old][0] / "checkpoints" / "step_00000012"
    target = tmp_path / "run" / "checkpoints" / "step_00000012"
    shutil.copytree(source, target)
    before = {p.name: p.read_bytes() for p in target.iterdir()}
    result = run_pretrain(train_overrides(digits_shards, tmp_path, **STEPS,
                                          **{"data.batch_size": 16 // new}), nproc=new)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"written by {old} ranks, resumed on {new}" in result.stderr
    assert "at step 12" in result.stderr
    assert {p.name: p.read_bytes() for p in target.iterdir()} == before  # never rewritten
    final = final_model(tmp_path / "run")
    assert final["step"] == 24 and final["world"] == new
    uninterrupted = references[old][1]  # the run that was preempted, had it gone on
    # the schedule continues exactly: the same learning rate at every logged step
    assert logged(result.stderr, "lr") == {s: v for s, v in logged(uninterrupted, "lr").items()
                                           if s > 12}
    # the loss trajectory: after the resume the ranks draw other samples than the
    # uninterrupted run would have (streams are seeded per rank and world), so the curves
    # agree in distribution, not value: the mean of the 6 logged rows after step 12 must
    # agree within 3 standard errors of the difference, from the rows' own spread.
    resumed, reference = logged(result.stderr, "loss"), logged(uninterrupted, "loss")
    after = [s for s in reference if s > 12]
    a, b = torch.tensor([resumed[s] for s in after]), torch.tensor([reference[s] for s in after])
    tolerance = 3 * float((a.var() / len(a) + b.var() / len(b)).sqrt())
    assert abs(float(a.mean() - b.mean())) < tolerance, (a, b)


@pytest.mark.parametrize(("old", "new"), [(1, 2), (2, 1)])
def test_the_resumed_ranks_hold_the_checkpoint_weights(references, digits_shards, tmp_path,
                                                       old, new):
    """The model and optimizer state carry over exactly. At a learning rate of 1e-30 new
    gradients move nothing (far below float32 resolution), so 12 resumed LARS steps only
    play out the checkpoint's momentum: v <- 0.9 v, w <- w - v. The final weights must
    equal that replay of the checkpoint's weights and velocities, done here in float32
    (to 1e-9 absolute: the 1e-30-scaled gradient terms are all that is left out)."""
    source = references[old][0] / "checkpoints" / "step_00000012"
    shutil.copytree(source, tmp_path / "run" / "checkpoints" / "step_00000012")
    result = run_pretrain(train_overrides(digits_shards, tmp_path, **STEPS, **{
        "data.batch_size": 16 // new, "optim.lr": 1e-30}), nproc=new)
    assert result.returncode == 0, result.stderr[-3000:]
    checkpoint = torch.load(source / "shared.pt", weights_only=True)
    end = final_model(tmp_path / "run")
    assert end["step"] == 24 and end["world"] == new
    model = checkpoint["model"]
    parameters = [k for k in model if "running_" not in k and "num_batches" not in k]
    ordered = ([k for k in parameters if model[k].ndim >= 2]  # LARS's two groups
               + [k for k in parameters if model[k].ndim < 2])
    velocity = {ordered[i]: s["velocity"] for i, s in checkpoint["optimizer"]["state"].items()}
    assert len(velocity) == len(parameters) > 10
    for key in parameters:
        weight, v = model[key].clone(), velocity[key].clone()
        for _ in range(12):
            v.mul_(0.9)
            weight.sub_(v)
        assert not torch.equal(weight, model[key]), key  # the momentum did move it
        torch.testing.assert_close(end["model"][key], weight, rtol=0, atol=1e-9, msg=key)


def test_sharded_optimizer_state_on_another_world_is_refused_and_kept(digits_shards, tmp_path):
    zero = {"engine.name": "deepspeed", "engine.deepspeed_config": "launch/deepspeed/zero2.json",
            "train.max_steps": 4, "checkpoint.every": 4, "data.workers": 1}
    first = run_pretrain(train_overrides(digits_shards, tmp_path, **zero), nproc=2)
    assert first.returncode == 0, first.stderr[-3000:]
    checkpoint = tmp_path / "run" / "checkpoints" / "step_00000004"
    before = {p.name: p.read_bytes() for p in checkpoint.iterdir()}
    command = pretrain_command(train_overrides(digits_shards, tmp_path, **{
        **zero, "train.max_steps": 8}), nproc=2)  # torchrun, as DeepSpeed needs it
    command[command.index("--nproc_per_node") + 1] = "1"
    again = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert again.returncode == 1
    assert (f"pretrain: error: {checkpoint} was written by 2 ranks with sharded optimizer "
            "state (DeepSpeed ZeRO) and this run has 1: resume it on 2 ranks (the checkpoint "
            "is kept)") in again.stderr.splitlines()  # the worker's line (then torchrun's)
    assert {p.name: p.read_bytes() for p in checkpoint.iterdir()} == before
    assert sorted(p.name for p in checkpoint.parent.iterdir()) == ["step_00000004"]


def test_never_starts_over_checkpoints_it_cannot_use(digits_shards, tmp_path):
    common = {"train.max_steps": 4, "checkpoint.every": 2, "data.workers": 1}
    assert run_pretrain(train_overrides(digits_shards, tmp_path, **common)).returncode == 0
    root = tmp_path / "run" / "checkpoints"
    never = run_pretrain(train_overrides(digits_shards, tmp_path, **{
        **common, "checkpoint.resume": "never"}))
    assert never.returncode == 1
    assert never.stderr.strip().splitlines()[-1] == (
        f"pretrain: error: {root} holds checkpoints and checkpoint.resume=never would "
        "overwrite them: choose another name or output_dir")
    for step in ("step_00000002", "step_00000004"):  # every checkpoint corrupt
        (root / step / "shared.pt").write_bytes(b"not a checkpoint")
    corrupt = run_pretrain(train_overrides(digits_shards, tmp_path, **{
        **common, "train.max_steps": 6, "tracking.enabled": True,
        "tracking.system_metrics": False}))
    assert corrupt.returncode == 1
    assert "no checkpoint of" in corrupt.stderr.strip().splitlines()[-1]
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'run' / 'mlflow.db'}")
    run = client.get_run((tmp_path / "run" / "mlflow_run_id").read_text())
    assert run.info.status == "FAILED"  # not left RUNNING
    assert sorted(p.name for p in root.iterdir()) == ["step_00000002_unreadable",
                                                      "step_00000004_unreadable"]
    assert all((root / name / "shared.pt").read_bytes() == b"not a checkpoint"
               for name in ("step_00000002_unreadable", "step_00000004_unreadable"))
