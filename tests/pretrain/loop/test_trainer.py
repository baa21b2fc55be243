"""Training loop behaviour that needs a whole run: non-finite losses, 2 ranks, DeepSpeed,
missing inputs named before work starts."""

from __future__ import annotations

import re

import pytest
import torch

from tests.app.helpers import run_pretrain, train_overrides
from tests.pretrain.distributed.test_engine import ZERO3


@pytest.mark.parametrize(("engine", "zero", "nproc"), [
    ("ddp", "", 1), ("ddp", "", 2), ("deepspeed", "launch/deepspeed/zero2.json", 2),
    ("deepspeed", ZERO3, 2)], ids=["ddp-1", "ddp-2", "zero2-2", "zero3-2"])
def test_nonfinite_losses_skip_updates_then_stop_the_run(digits_shards, tmp_path, engine,
                                                         zero, nproc):
    # tau = 1e-45 is a float32 denormal: 1/tau overflows, every loss is NaN.
    overrides = train_overrides(digits_shards, tmp_path, **{
        "objective.temperature": 1e-45, "train.max_nonfinite": 3, "train.max_steps": 10,
        "engine.name": engine, "engine.deepspeed_config": zero or "launch/deepspeed/zero1.json",
        "data.workers": 1})
    result = run_pretrain(overrides, nproc=nproc)
    assert result.returncode != 0
    if engine == "deepspeed":  # DeepSpeed's step decides on the host: it stops at once
        assert result.stderr.count("update skipped") == 3 * nproc  # every rank skips
        assert "3 non-finite losses in a row (train.max_nonfinite=3) by step 2" in result.stderr
    else:  # DDP skips on the device and reads the count at each report (log_every=2)
        assert result.stderr.count("non-finite loss in 2 step(s) up to step 2; update skipped "
                                   "(2 in a row, 2 in total)") == nproc
        assert "4 non-finite losses in a row (train.max_nonfinite=3) by step 4" in result.stderr
    assert not list((tmp_path / "run").glob("checkpoints/step_*"))  # nothing was trained


def test_two_ranks_deepspeed_run_resumes_where_it_stopped(digits_shards, tmp_path):
    common = train_overrides(digits_shards, tmp_path, **{
        "engine.name": "deepspeed", "engine.deepspeed_config": "launch/deepspeed/zero2.json",
        "objective.name": "sincere", "checkpoint.every": 3, "data.workers": 1})
    first = run_pretrain([*common, "train.max_steps=3"], nproc=2)
    assert first.returncode == 0, first.stderr[-3000:]
    second = run_pretrain([*common, "train.max_steps=6"], nproc=2)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in second.stderr and "at step 3" in second.stderr
    step6 = tmp_path / "run" / "checkpoints" / "step_00000006"
    assert sorted(p.name for p in step6.iterdir()) == ["rank_000.pt", "rank_001.pt",
                                                       "shared.pt"]
    own = torch.load(step6 / "rank_001.pt", weights_only=True)
    assert "optimizer" in own  # ZeRO: each rank keeps its optimizer partition


def test_missing_class_graph_is_named_before_training(digits_shards, tmp_path):
    overrides = train_overrides(digits_shards, tmp_path, **{
        "objective.name": "xclr", "objective.xclr.class_graph": tmp_path / "missing.npz"})
    result = run_pretrain(overrides)
    assert result.returncode != 0
    assert "objective.xclr.class_graph=" in result.stderr and "missing.npz" in result.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_bf16_autocast_and_learnable_temperature_run(digits_shards, tmp_path):
    overrides = train_overrides(digits_shards, tmp_path, **{
        "train.precision": "bf16", "objective.name": "clip",
        "objective.learnable_temperature": True, "train.max_steps": 2})
    result = run_pretrain(overrides)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "cpu, bf16;" in result.stderr and "2 steps to go" in result.stderr
    state = torch.load(tmp_path / "run" / "checkpoints" / "step_00000002" / "shared.pt",
                       weights_only=True)
    assert state["model"]["log_temperature"].item() != pytest.approx(torch.tensor(0.1).log())
    assert any(key.startswith("text.projection") for key in state["model"])


def test_ess_controller_steers_the_temperature(digits_shards, tmp_path):
    overrides = train_overrides(digits_shards, tmp_path, **{
        "objective.name": "flatnce", "objective.ess_control.enabled": True,
        "objective.ess_control.target": 0.05, "objective.ess_control.rate": 0.2,
        "train.max_steps": 4, "train.log_every": 1})
    result = run_pretrain(overrides)
    assert result.returncode == 0, result.stderr[-3000:]
    temperatures = [float(t) for t in re.findall(r" temperature=([\d.e-]+)", result.stderr)]
    # ESS starts far above 0.05, so beta rises by 20% a step: tau = 0.1 / 1.2^step
    assert temperatures == pytest.approx([0.1 / 1.2 ** s for s in range(1, 5)], rel=1e-3)


def test_skips_are_summarised_when_max_steps_stops_mid_epoch(tmp_path):
    import mlflow

    from tests.data_pipeline.helpers import (
        cut_inside_header,
        digit_sample,
        refresh_manifest,
        write_set,
    )

    shards = tmp_path / "shards"
    write_set(shards, [[digit_sample(i) for i in range(60)]])
    cut_inside_header(shards / "shard-000000.tar", "s00040.cls")  # its first member
    refresh_manifest(shards)
    result = run_pretrain(train_overrides(shards, tmp_path, **{
        "train.max_steps": 2, "data.max_skip_fraction": 0.5, "tracking.enabled": True,
        "tracking.system_metrics": False, "tracking.log_model": False}))  # epoch: 3 steps
    assert result.returncode == 0, result.stderr[-3000:]
    total = re.search(r"skipped per reason over all ranks: \{'truncated_shard': (\d+)\}",
                      result.stderr)
    # each of the 20 lost samples counts once, in the batch its position falls in: those
    # of the 2 batches delivered
    assert total and 0 < int(total.group(1)) <= 20
    assert f"{total.group(1)}  truncated_shard shard-000000.tar" in result.stderr
    assert re.search(r"truncated_shard shard-000000.tar (40 of the manifest's 60 samples read"
                     r"|no sample from \d+ on \(the manifest lists 60\))", result.stderr)
    uri = f"sqlite:///{tmp_path / 'run' / 'mlflow.db'}"
    client = mlflow.MlflowClient(uri)
    run_id = (tmp_path / "run" / "mlflow_run_id").read_text()
    logged = client.get_metric_history(run_id, "skipped.truncated_shard")
    assert [(m.step, m.value) for m in logged] == [(2, float(total.group(1)))]
    assert client.get_metric_history(run_id, "skipped.corrupt_image")[0].value == 0


def test_two_ranks_train_on_views_rendered_by_dali(digits_shards, tmp_path):
    """data.backend=dali through the whole run (DALI's CPU operators here): each rank's
    main process decodes and renders its views; checkpoints and the loader state as ever."""
    overrides = train_overrides(digits_shards, tmp_path, **{
        "data.backend": "dali", "train.max_steps": 3, "checkpoint.every": 3, "data.workers": 1})
    result = run_pretrain(overrides, nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    step3 = tmp_path / "run" / "checkpoints" / "step_00000003"
    own = torch.load(step3 / "rank_001.pt", weights_only=True)
    assert own["loader"]["batches"] == 3
