"""A training step never waits on the host: metrics, the finite check and the skipped
update stay on the device, and the host reads them once per ``train.log_every`` steps.

A host synchronisation is a read of a tensor's value into Python (``float``, ``bool``,
``item``): the ``aten._local_scalar_dense`` operator, which a dispatch mode counts."""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from core.runtime import Runtime
from pretrain.distributed.engine import DDPEngine, EngineConfig
from pretrain.distributed.engine_base import step_unless
from pretrain.loop.device_metrics import MetricWindow, NonFiniteGuard, NonFiniteLoss
from pretrain.loop.optim import OptimConfig, build_optimizer
from pretrain.loop.step import Objective
from pretrain.loop.trainer import RunLength, TrainConfig, Trainer
from pretrain.model.encoder import ModelConfig, build_model
from pretrain.objectives import EssControlConfig, ObjectiveConfig
from pretrain.run.checkpoint import CheckpointConfig, Checkpointer

CPU = torch.device("cpu")


# decompositions whose CUDA kernels read their status back to the host to check it (seen
# on an H100: bench/gpu, part sync); on a CPU they read nothing a dispatch mode can see
CHECKED_ON_THE_HOST = {torch.ops.aten._linalg_svd.default, torch.ops.aten._linalg_eigh.default}


class HostReads(TorchDispatchMode):
    """Counts reads of tensor values into Python, and the decompositions a GPU would check
    on the host."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default or func in CHECKED_ON_THE_HOST:
            self.count += 1
        return func(*args, **(kwargs or {}))


def trainer(tmp_path: Path, optimizer: str, objective: ObjectiveConfig,
            **train: object) -> Trainer:
    model = build_model(ModelConfig(width=8, projector_hidden=32, projector_dim=16),
                        objective, CPU)
    engine = DDPEngine(model, build_optimizer(model, OptimConfig(name=optimizer, lr=0.1), 32),
                       EngineConfig(gradient_clipping=1.0), CPU)
    return Trainer(TrainConfig(log_every=4, progress=False, **train), engine=engine,
                   objective=Objective(objective), loader=None,
                   checkpointer=Checkpointer(tmp_path, CheckpointConfig(every=0), 0, 1, CPU),
                   schedule=lambda samples: 1.0, length=RunLength(16, 1600, max_steps=100),
                   runtime=Runtime(0, 1, 0, CPU), precision="fp32")


BATCH = {"images": torch.randn(32, 3, 16, 16, generator=torch.Generator().manual_seed(0)),
         "ids": torch.arange(16).repeat(2)}


@pytest.mark.parametrize("optimizer", ["lars", "sgd", "adamw"])
@pytest.mark.parametrize("variant", ["plain", "ess_control", "chunks"])
def test_a_step_reads_nothing_until_the_report(tmp_path, optimizer, variant):
    objective = ObjectiveConfig(name="flatnce", temperature=0.2, ess_control=EssControlConfig(
        enabled=variant == "ess_control", target=0.5))
    run = trainer(tmp_path, optimizer, objective,
                  chunk_size=12 if variant == "chunks" else 0)
    reads = []
    for _ in range(4):
        probe = HostReads()
        with probe:
            run.train_step(dict(BATCH))
        reads.append(probe.count)
    assert reads[:3] == [0, 0, 0], reads  # the 4th step reports (its reads are tolist's)
    assert run.last_row["step"] == 4 and run.last_row["loss"] == run.last_row["loss"]


@pytest.mark.parametrize("optimizer", ["lars", "sgd", "adamw"])
def test_a_masked_step_skips_exactly(optimizer):
    """Skipped steps (including the first) leave weights and optimiser state as they were;
    the others equal plain steps. Float64."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Linear(4, 3)).double()
    masked = build_optimizer(model, OptimConfig(name=optimizer, lr=0.05), 256)
    twin = copy.deepcopy(model)
    plain = build_optimizer(twin, OptimConfig(name=optimizer, lr=0.05), 256)
    for step, skip in enumerate([True, False, True, False, False]):
        for net in (model, twin):
            for p in net.parameters():
                p.grad = torch.full_like(p, float("nan")) if skip else torch.cos(p + step)
        step_unless(masked, torch.tensor(skip))
        if not skip:
            plain.step()
        for p, q in zip(model.parameters(), twin.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_the_window_averages_finite_values_per_step():
    window = MetricWindow()
    for loss in (1.0, float("nan"), 3.0):
        window.add({"loss": torch.tensor(loss), "ess": torch.tensor(0.5)})
    assert window.means_over_ranks() == pytest.approx({"loss": 4.0 / 3, "ess": 0.5})
    assert window.means_over_ranks() == {}


def test_a_metric_measured_on_some_steps_is_their_mean():
    window = MetricWindow()
    window.add({"loss": torch.tensor(1.0)})
    window.add({"loss": torch.tensor(2.0)}, counted=torch.tensor(False))  # a placeholder
    window.add({"loss": torch.tensor(3.0), "effective_rank": torch.tensor(7.0)})
    assert window.means_over_ranks() == pytest.approx({"loss": 2.0, "effective_rank": 7.0})


def test_the_effective_rank_is_measured_on_the_reporting_steps_only(tmp_path, monkeypatch):
    import pretrain.loop.trainer as trainer_module

    measured = []
    monkeypatch.setattr(trainer_module, "effective_rank",
                        lambda z: measured.append(len(z)) or torch.tensor(3.0))
    run = trainer(tmp_path, "sgd", ObjectiveConfig(name="infonce"))
    for _ in range(8):
        run.train_step(dict(BATCH))
    assert measured == [32, 32]  # steps 4 and 8 report (log_every=4)
    assert run.last_row["effective_rank"] == 3.0


def test_the_guard_counts_on_the_device_and_stops_at_the_check(caplog):
    guard = NonFiniteGuard(limit=3, device=CPU)
    probe = HostReads()
    with probe:
        for finite in (True, False, False, True, False, False):
            guard.record(torch.tensor(finite))
    assert probe.count == 0
    with caplog.at_level(logging.WARNING):
        assert guard.check(step=6) == 4
    assert "non-finite loss in 4 step(s) up to step 6; update skipped (2 in a row, 4 in " \
           "total)" in caplog.text
    guard.record(torch.tensor(False))  # 3 in a row, across the check
    with pytest.raises(NonFiniteLoss, match=r"3 non-finite losses in a row "
                                            r"\(train.max_nonfinite=3\) by step 7"):
        guard.check(step=7)
