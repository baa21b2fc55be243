"""Resuming on another number of ranks: a checkpoint of 1 rank continues on 2 and one of 2
on 1, with replicated (DDP) and sharded (DeepSpeed ZeRO-2, ZeRO-3) optimizer state, and across
engines (FSDP2 on 2 ranks -> DDP on 1, DDP on 1 -> FSDP2 on 2: FSDP2 checkpoints the full
state in DDP's layout, or with checkpoint.format=sharded each rank its shards), and
2 -> 1 -> 3 ranks through sharded checkpoints, against the uninterrupted run; a checkpoint
of the other engine kind is refused and kept; a run never starts over checkpoints it cannot
resume. The optimizer layouts alone, against layouts built directly:
``test_reshard_layouts.py``."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import mlflow
import pytest
import torch

from pretrain.run.checkpoint import model_state_of
from pretrain.run.sharded import read_whole
from tests.app.helpers import run_pretrain, train_overrides
from tests.pretrain.distributed.test_engine import ZERO3
from tests.pretrain.run.test_checkpoint import final_model
from tests.scratch import scratch_dir

pytestmark = pytest.mark.long_file  # collected first: tests/conftest.py

STEPS = {"train.max_steps": 24, "checkpoint.every": 4, "checkpoint.keep": 10,
         "data.workers": 1, "optim.lr": 0.3}
ENGINES = {"ddp": {}, "zero2": {"engine.name": "deepspeed",
                                "engine.deepspeed_config": "launch/deepspeed/zero2.json"},
           "zero3": {"engine.name": "deepspeed", "engine.deepspeed_config": ZERO3},
           "fsdp2": {"engine.name": "fsdp2"},
           "fsdp2-sharded": {"engine.name": "fsdp2", "checkpoint.format": "sharded"}}
# (engine that wrote the checkpoint, its ranks, engine that resumes, its ranks): DDP and
# ZeRO-2 each 1 -> 2 and 2 -> 1; FSDP2 (its full state in DDP's layout) to DDP and back; a
# sharded (DCP) checkpoint of FSDP2 on 2 ranks, read whole by DDP on 1; ZeRO-2's
# partitions on 2 ranks joined per parameter for FSDP2 on 2; ZeRO-3 (every parameter
# partitioned) on 2 ranks resumed by each rank from its own partition, cut anew for 3
# ranks, and joined for DDP on 1
CASES = [(engine, old, engine, new) for engine in ("ddp", "zero2")
         for old, new in ((1, 2), (2, 1))] + [
    ("fsdp2", 2, "ddp", 1), ("ddp", 1, "fsdp2", 2), ("fsdp2-sharded", 2, "ddp", 1),
    ("zero2", 2, "fsdp2", 2), ("zero3", 2, "zero3", 2), ("zero3", 2, "zero3", 3),
    ("zero3", 2, "ddp", 1)]
IDS = [f"{a}-{old}to{new}" if a == b else f"{a}-{old}-to-{b}-{new}" for a, old, b, new in CASES]


def train(shards: Path, out: Path, engine: str, world: int, **extra: object):
    """A run of global batch 16 on ``world`` ranks (torchrun for more than one, and for
    DeepSpeed, which needs its environment even on one)."""
    overrides = train_overrides(shards, out, **{**STEPS, **ENGINES[engine],
                                                "data.batch_size": 16 // world, **extra})
    deepspeed = ENGINES[engine].get("engine.name") == "deepspeed"
    return run_pretrain(overrides, nproc=world, torchrun=world > 1 or deepspeed)


def logged(stderr: str, key: str) -> dict[int, float]:
    """{step: value} of ``key`` in the training log's metric rows."""
    return {int(step): float(re.search(rf"\b{key}=(\S+)", row).group(1))
            for step, row in re.findall(r"INFO: step (\d+) (.*)", stderr)}


@pytest.fixture(scope="module")
def references(digits_shards, tmp_path_factory):
    """Uninterrupted runs at global batch 16 (1 rank x 16, 2 ranks x 8), made on first use:
    {(engine, world): (run dir, its log)}."""
    runs = {}
    with scratch_dir(tmp_path_factory, "reshard") as root:
        def reference(engine: str, world: int) -> tuple[Path, str]:
            if (engine, world) not in runs:
                result = train(digits_shards, root / f"{engine}{world}", engine, world)
                assert result.returncode == 0, result.stderr[-3000:]
                runs[engine, world] = (root / f"{engine}{world}" / "run", result.stderr)
            return runs[engine, world]
        yield reference


def test_the_loss_after_a_resharded_resume_follows_the_uninterrupted_run(references,
                                                                        digits_shards,
                                                                        tmp_path):
    """ZeRO-2 on 2 ranks resumed on 1 at the recipe's learning rate: the loss trajectory,
    in distribution. After the resume the rank trains on exactly the samples the old run
    left in the epoch (tests/data_pipeline/test_plan.py), in other batches. The loss
    depends on the per-rank batch (BatchNorm statistics per rank: 2 x 8 logs ~0.5 more
    than 1 x 16 here from step 12 on), so the resumed run is compared with the
    uninterrupted run on 1 rank: the mean of the 6 logged rows after step 12 must agree
    within 3 standard errors of the difference, from the rows' spread. The exact carry-over
    of weights, momentum and schedule for every engine and direction is
    :func:`test_a_checkpoint_resumes_on_another_number_of_ranks`."""
    source = references("zero2", 2)[0] / "checkpoints" / "step_00000012"
    shutil.copytree(source, tmp_path / "run" / "checkpoints" / "step_00000012")
    result = train(digits_shards, tmp_path, "zero2", 1)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "written by 2 ranks, resumed on 1" in result.stderr
    resumed, reference = logged(result.stderr, "loss"), logged(references("zero2", 1)[1],
                                                                "loss")
    after = [s for s in reference if s > 12]
    assert len(after) == 6 and set(after) <= set(resumed)
    a, b = torch.tensor([resumed[s] for s in after]), torch.tensor([reference[s] for s in after])
    tolerance = 3 * float((a.var() / len(a) + b.var() / len(b)).sqrt())
    assert abs(float(a.mean() - b.mean())) < tolerance, (a, b)


def parameter_names(model: dict[str, torch.Tensor]) -> list[list[str]]:
    """The trained tensors of a model state, in LARS's two parameter groups (weights with
    decay, then biases and norms), each in the model's order."""
    names = [k for k in model if "running_" not in k and "num_batches" not in k]
    return [[k for k in names if model[k].ndim >= 2], [k for k in names if model[k].ndim < 2]]


def velocities(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Each parameter's LARS velocity in a checkpoint. DDP and FSDP2 save them per
    parameter; ZeRO saves, per rank and group, the rank's slice of the group's parameters
    flattened in order (the partition, padded at the end of the last rank), so the group is
    the ranks' slices joined without their padding."""
    shared, model = model_state_of(checkpoint)
    groups = parameter_names(model)
    if shared.get("state") == "dcp":  # sharded: each parameter's, by name
        state = read_whole(checkpoint / "state", "optimizer.state.")
        return {name: state[f"{name}.velocity"] for name in sum(groups, [])}
    if "optimizer" in shared:
        state = shared["optimizer"]["state"]
        return {name: state[i]["velocity"] for i, name in enumerate(sum(groups, []))}
    parts = [torch.load(checkpoint / f"rank_{r:03d}.pt", weights_only=True)["optimizer"]
             for r in range(shared["world"])]
    if "fp32_flat_groups" in parts[0]:
        return zero3_velocities(parts, model, groups)
    out = {}
    for i, names in enumerate(groups):
        flat = torch.cat([p["base_optimizer_state"]["state"][i]["velocity"][
            :p["single_partition_of_fp32_groups"][i].numel()] for p in parts])
        sizes = [shared["model"][name].numel() for name in names]
        assert flat.numel() == sum(sizes)
        for name, piece in zip(names, flat.split(sizes), strict=True):
            out[name] = piece.view_as(shared["model"][name])
    return out


def zero3_velocities(parts: list[dict], model: dict[str, torch.Tensor],
                     groups: list[list[str]]) -> dict[str, torch.Tensor]:
    """Each parameter's velocity in ZeRO-3 partitions: every parameter is padded to a
    multiple of the ranks and cut evenly, each rank's flat group its pieces in order (the
    small test model's groups are one sub-group each)."""
    world, out = len(parts), {}
    for i, names in enumerate(groups):
        pieces = [-(-model[name].numel() // world) for name in names]
        flats = [p["optimizer_state_dict"]["state"][i]["velocity"].split(pieces)
                 for p in parts]
        for k, name in enumerate(names):
            whole = torch.cat([flat[k] for flat in flats])[:model[name].numel()]
            out[name] = whole.view_as(model[name])
    return out


@pytest.mark.parametrize(("engine", "old", "resumer", "new"), CASES, ids=IDS)
def test_a_checkpoint_resumes_on_another_number_of_ranks(references, digits_shards, tmp_path,
                                                         engine, old, resumer, new):
    """The step-12 checkpoint of ``old`` ranks resumed on ``new``, to step 24, at a learning
    rate of 1e-30 (the recipe's 0.3 times 1e-30/0.3): the checkpoint is read, never
    rewritten; the schedule continues exactly; the model and optimizer state carry over
    exactly. At that rate new gradients move nothing (far below float32 resolution), so 12
    resumed LARS steps only play out the checkpoint's momentum: v <- 0.9 v, w <- w - v.
    The final weights must equal that replay of the checkpoint's weights and velocities,
    done here in float32 (to 1e-9 absolute: the 1e-30-scaled gradient terms are all that
    is left out)."""
    source = references(engine, old)[0] / "checkpoints" / "step_00000012"
    target = tmp_path / "run" / "checkpoints" / "step_00000012"
    shutil.copytree(source, target)
    before = contents(target)
    result = train(digits_shards, tmp_path, resumer, new, **{"optim.lr": 1e-30})
    assert result.returncode == 0, result.stderr[-3000:]
    if old != new:
        assert re.search(rf"written by {old} ranks( under DeepSpeed ZeRO)?, resumed on {new}",
                         result.stderr)
    assert "at step 12" in result.stderr
    assert contents(target) == before  # never rewritten
    end = final_model(tmp_path / "run")
    assert end["step"] == 24 and end["world"] == new
    # the schedule continues where the uninterrupted run was: at every logged step the lr
    # is that run's times 1e-30 / 0.3 (to the log's 4 significant digits: 1e-3 relative)
    uninterrupted = logged(references(engine, old)[1], "lr")
    lrs = logged(result.stderr, "lr")
    assert sorted(lrs) == [s for s in sorted(uninterrupted) if s > 12]
    for step, lr in lrs.items():
        assert lr == pytest.approx(uninterrupted[step] * 1e-30 / STEPS["optim.lr"],
                                   rel=1e-3), step
    expected = replayed(source, 12)
    assert len(expected) == len(sum(parameter_names(model_state_of(source)[1]), [])) > 10
    for key, weight in expected.items():
        torch.testing.assert_close(end["model"][key], weight, rtol=0, atol=1e-9, msg=key)


def contents(directory: Path) -> dict[Path, bytes]:
    """Every file under ``directory`` (a sharded checkpoint's ``state/`` included)."""
    return {p.relative_to(directory): p.read_bytes() for p in directory.rglob("*")
            if p.is_file()}


def replayed(checkpoint: Path, steps: int) -> dict[str, torch.Tensor]:
    """The checkpoint's weights after ``steps`` LARS steps of momentum alone (v <- 0.9 v,
    w <- w - v), in float32: what a run resumed from it at a learning rate of 1e-30 ends
    with."""
    model = model_state_of(checkpoint)[1]
    out = {}
    for key, v in velocities(checkpoint).items():
        weight, v = model[key].clone(), v.clone()
        for _ in range(steps):
            v.mul_(0.9)
            weight.sub_(v)
        assert not torch.equal(weight, model[key]), key  # the momentum did move it
        out[key] = weight
    return out


def test_a_run_moves_from_two_ranks_to_one_to_three(references, digits_shards, tmp_path):
    """2 FSDP2 ranks -> 1 DDP rank -> 3 FSDP2 ranks (each parameter's first dimension now
    cut unevenly), through sharded checkpoints: the weights and LARS momentum carry over
    both moves exactly (:func:`replayed` over all 12 resumed steps)."""
    source = references("fsdp2-sharded", 2)[0] / "checkpoints" / "step_00000012"
    shutil.copytree(source, tmp_path / "run" / "checkpoints" / "step_00000012")
    slow = {"optim.lr": 1e-30, "checkpoint.format": "sharded"}
    one = train(digits_shards, tmp_path, "ddp", 1, **slow, **{"train.max_steps": 16})
    assert one.returncode == 0, one.stderr[-3000:]
    assert "written by 2 ranks, resumed on 1" in one.stderr
    three = train(digits_shards, tmp_path, "fsdp2-sharded", 3, **slow)
    assert three.returncode == 0, three.stderr[-3000:]
    assert "step_00000016: written by 1 ranks, resumed on 3" in three.stderr
    end = final_model(tmp_path / "run")
    assert end["step"] == 24 and end["world"] == 3
    expected = replayed(source, 12)
    assert len(expected) > 10
    for key, weight in expected.items():
        torch.testing.assert_close(end["model"][key], weight, rtol=0, atol=1e-9, msg=key)


def test_async_checkpoints_hold_what_synchronous_ones_hold(references, digits_shards,
                                                          tmp_path):
    """``checkpoint.async_save``: 2 FSDP2 ranks write their shards in the background while
    training goes on. Every checkpoint holds exactly the synchronous run's weights and
    momentum (the state was copied before the next step changed it), and a run resumed
    from one ends where the uninterrupted run ends."""
    result = train(digits_shards, tmp_path / "async", "fsdp2-sharded", 2,
                   **{"checkpoint.async_save": True})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "step_00000004 (its state being written in the background)" in result.stderr
    written = tmp_path / "async" / "run" / "checkpoints"
    reference = references("fsdp2-sharded", 2)[0] / "checkpoints"
    steps = sorted(p.name for p in written.iterdir())
    assert steps == [f"step_{s:08d}" for s in (4, 8, 12, 16, 20, 24)]
    for name in steps:
        assert_same_tensors(model_state_of(written / name)[1],
                            model_state_of(reference / name)[1], name)
        assert_same_tensors(velocities(written / name), velocities(reference / name), name)
    shutil.copytree(written / "step_00000012",
                    tmp_path / "resumed" / "run" / "checkpoints" / "step_00000012")
    resumed = train(digits_shards, tmp_path / "resumed", "fsdp2-sharded", 2,
                    **{"checkpoint.async_save": True})
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "at step 12" in resumed.stderr
    assert_same_tensors(final_model(tmp_path / "resumed" / "run")["model"],
                        model_state_of(reference / "step_00000024")[1], "resumed")


def assert_same_tensors(found: dict[str, torch.Tensor], expected: dict[str, torch.Tensor],
                        where: str) -> None:
    assert set(found) == set(expected), where
    for key, value in expected.items():
        assert torch.equal(found[key], value), f"{where}: {key}"


def test_a_checkpoint_of_the_other_engine_kind_is_refused_and_kept(digits_shards, tmp_path):
    first = train(digits_shards, tmp_path, "ddp", 1, **{"train.max_steps": 4})
    assert first.returncode == 0, first.stderr[-3000:]
    checkpoint = tmp_path / "run" / "checkpoints" / "step_00000004"
    before = contents(checkpoint)
    again = train(digits_shards, tmp_path, "zero2", 1, **{"train.max_steps": 8})
    assert again.returncode == 1
    assert "optim.name=lars inside DeepSpeed ZeRO" in again.stderr  # the default optimiser
    assert (f"pretrain: error: {checkpoint} holds replicated optimizer state (DDP) and this "
            "run has sharded optimizer state (DeepSpeed ZeRO): resume it with the engine that "
            "wrote it (the checkpoint is kept)") in again.stderr.splitlines()
    assert contents(checkpoint) == before
    assert sorted(p.name for p in checkpoint.parent.iterdir()) == ["step_00000004"]


def test_a_checkpoint_of_another_zero_stage_is_refused_and_kept(references, digits_shards,
                                                                tmp_path):
    source = references("zero2", 2)[0] / "checkpoints" / "step_00000012"
    checkpoint = tmp_path / "run" / "checkpoints" / "step_00000012"
    shutil.copytree(source, checkpoint)
    before = contents(checkpoint)
    again = train(digits_shards, tmp_path, "zero3", 2)
    assert again.returncode == 1
    assert (f"pretrain: error: {checkpoint}: written under ZeRO stage 1/2 and this run has "
            "stage 3: resume it with stage 1/2 (on any number of ranks) or with "
            "engine.name=ddp or fsdp2 (the checkpoint is kept)") in again.stderr.splitlines()
    assert contents(checkpoint) == before
    assert sorted(p.name for p in checkpoint.parent.iterdir()) == ["step_00000012"]


def test_a_zero3_checkpoint_of_another_model_stops_every_rank_in_one_line(
        references, digits_shards, tmp_path):
    """Every ZeRO-3 rank checks the checkpoint's model against its own before it gathers
    any module, so all stop alike (none waits in a collective for a rank that failed)."""
    source = references("zero3", 2)[0] / "checkpoints" / "step_00000012"
    checkpoint = tmp_path / "run" / "checkpoints" / "step_00000012"
    shutil.copytree(source, checkpoint)
    again = train(digits_shards, tmp_path, "zero3", 2, **{
        "model.width": 16, "checkpoint.allow_changes": "[model.width]"})
    assert again.returncode == 1
    lines = [line for line in again.stderr.splitlines() if line.startswith(
        f"pretrain: error: {checkpoint}: its tensors do not fit the configured model "
        "(size mismatch for ")]
    assert len(lines) == 2 and "model.width=64 in the checkpoint, 16 here" in lines[0], \
        again.stderr[-3000:]


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


def test_deepspeed_refuses_sharded_checkpoints_before_training(digits_shards, tmp_path):
    refused = train(digits_shards, tmp_path, "zero2", 1, **{"checkpoint.format": "sharded"})
    assert refused.returncode == 1
    assert ("pretrain: error: checkpoint.format=sharded: engine.name=deepspeed keeps its own "
            "optimizer partitions; use checkpoint.format=full, or engine.name=ddp or fsdp2"
            ) in refused.stderr.splitlines()
    assert not (tmp_path / "run" / "checkpoints").exists()
