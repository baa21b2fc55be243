"""Collapse detection: the effective rank against its definition, the watch's verdicts on
metric rows, and a run that shows collapse warns and then stops with the advice."""

from __future__ import annotations

import math

import pytest
import torch

from pretrain.loop.collapse import (
    CollapseConfig,
    Collapsed,
    CollapseWatch,
    backbone_measures,
    effective_rank,
)
from pretrain.loop.step import Objective
from pretrain.loop.trainer import forward_loss
from pretrain.model.encoder import ContrastiveModel, ModelConfig
from pretrain.objectives import ObjectiveConfig
from tests.app.helpers import run_pretrain, train_overrides


def test_effective_rank_against_its_definition():
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(40, 8, generator=gen, dtype=torch.float64)
    rows = z / z.norm(dim=1, keepdim=True)
    s = torch.linalg.svdvals(rows)
    p = s / s.sum()
    assert float(effective_rank(z)) == pytest.approx(math.exp(float(-(p * p.log()).sum())),
                                                     rel=1e-6)
    same = torch.ones(16, 8) + 1e-7 * torch.randn(16, 8, generator=gen)
    assert float(effective_rank(same)) == pytest.approx(1.0, abs=1e-3)
    assert float(effective_rank(torch.eye(8))) == pytest.approx(8.0, rel=1e-6)


@pytest.mark.parametrize(("row", "collapsed"), [
    ({"pos_sim": 0.96, "neg_sim": 0.958, "effective_rank": 1.1}, True),   # one point
    ({"pos_sim": 0.95, "neg_sim": 0.949, "effective_rank": 9.0}, True),   # similarities met
    ({"pos_sim": 0.5, "neg_sim": 0.1, "effective_rank": 1.5}, True),      # a line
    ({"pos_sim": 0.01, "neg_sim": 0.0, "effective_rank": 40.0}, False),   # spread, not yet apart
    ({"pos_sim": 0.5, "neg_sim": 0.49, "effective_rank": 20.0}, False),   # how training starts
    ({"pos_sim": 0.6, "neg_sim": 0.05, "effective_rank": 30.0}, False),   # learning
])
def test_symptoms(row, collapsed):
    assert (CollapseWatch(CollapseConfig()).symptom(row) is not None) == collapsed


def test_patience_counts_rows_in_a_row():
    watch = CollapseWatch(CollapseConfig(patience=3))
    bad = {"pos_sim": 0.96, "neg_sim": 0.96, "effective_rank": 1.0}
    good = {"pos_sim": 0.6, "neg_sim": 0.1, "effective_rank": 30.0}
    for step, row in enumerate([bad, bad, good, bad, bad]):
        watch.check(step, row)
        watch.stop_if_spent()
    watch.check(5, bad)
    with pytest.raises(Collapsed, match="model.projector_bn_out=true"):
        watch.stop_if_spent()
    quiet = CollapseWatch(CollapseConfig(patience=0))
    for step in range(10):
        assert quiet.check(step, bad).startswith(f"step {step}: collapse warning")
        quiet.stop_if_spent()


def test_a_run_showing_collapse_warns_then_stops(digits_shards, tmp_path):
    """An impossible rank threshold makes every row look collapsed: the run warns on the
    log and stops at the patience with the advice, leaving no final checkpoint."""
    overrides = train_overrides(digits_shards, tmp_path, **{
        "train.collapse.min_rank": 1000, "train.collapse.patience": 2, "train.max_steps": 10,
        "checkpoint.every": 0})
    result = run_pretrain(overrides)
    assert result.returncode != 0
    assert result.stderr.count("collapse warning: the embeddings' effective rank fell") == 2
    assert "training collapsed at step 4" in result.stderr
    assert "model.projector_bn_out=true" in result.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_backbone_measures_against_a_loop_in_float64():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(12, 5, generator=gen, dtype=torch.float64).abs()
    ids = torch.arange(6).repeat(2)
    got = backbone_measures(x, ids)
    pairs = [(i, j) for i in range(12) for j in range(12) if ids[i] != ids[j]]
    cos = sum(float(x[i] @ x[j] / (x[i].norm() * x[j].norm())) for i, j in pairs) / len(pairs)
    mean = x.mean(0)
    spread = math.sqrt(sum(float((r - mean) @ (r - mean)) for r in x) / 12) / math.sqrt(
        sum(float(r @ r) for r in x) / 12)
    assert float(got["backbone_cos"]) == pytest.approx(cos, rel=1e-6)
    assert float(got["backbone_spread"]) == pytest.approx(spread, rel=1e-6)
    same = backbone_measures(torch.ones(8, 4) * 3, torch.arange(8))
    assert float(same["backbone_spread"]) == pytest.approx(0, abs=1e-6)
    assert float(same["backbone_cos"]) == pytest.approx(1, abs=1e-6)


class CollapsedBackbone(torch.nn.Module):
    """A backbone whose features of every image are nearly one vector (what the ViT's
    became under the SupCon recipe): 10 + 1e-3 x the real features."""

    def __init__(self, backbone: torch.nn.Module) -> None:
        super().__init__()
        self.inner = backbone

    def forward(self, images):
        return 10 + 1e-3 * self.inner(images)


def test_a_backbone_collapsed_behind_the_projector_s_batch_norm_is_caught():
    """The projections of a collapsed backbone still look healthy (the projector's
    batch-normalised output spreads what is left), so the projection signs stay quiet;
    the backbone's spread, against the run's first row, is what shows it."""
    torch.manual_seed(0)
    model = ContrastiveModel(ModelConfig(width=8, projector_hidden=32, projector_dim=16,
                                         projector_bn_out=True))
    images = torch.randn(64, 3, 16, 16)
    batch = {"images": images, "ids": torch.arange(32).repeat(2),
             "labels": torch.arange(32).repeat(2) % 4}
    objective = Objective(ObjectiveConfig(name="supcon"))
    watch = CollapseWatch(CollapseConfig())

    def row(model) -> dict[str, float]:
        out = forward_loss(model, batch, objective, 0)
        return {k: float(v) for k, v in out.metrics.items()}

    healthy = row(model)
    assert watch.check(10, healthy) is None
    model.encoder.backbone = CollapsedBackbone(model.encoder.backbone)
    collapsed = row(model)
    assert collapsed["effective_rank"] > 10  # the projections look spread
    assert collapsed["backbone_cos"] > 0.999 and collapsed["backbone_spread"] < 1e-3
    without_backbone = {k: v for k, v in collapsed.items() if not k.startswith("backbone")}
    assert CollapseWatch(CollapseConfig()).symptom(without_backbone) is None  # hidden before
    warning = watch.check(20, collapsed)
    assert warning is not None and "the backbone's features of different images became " \
        "alike" in warning, warning
    assert CollapseWatch(CollapseConfig(backbone_spread_ratio=0)).check(10, collapsed) is None


def test_the_first_spread_survives_a_resume():
    watch = CollapseWatch(CollapseConfig())
    watch.check(10, {"effective_rank": 50.0, "backbone_spread": 0.8})
    resumed = CollapseWatch(CollapseConfig())
    resumed.load_state_dict(watch.state_dict())
    assert resumed.check(20, {"effective_rank": 50.0, "backbone_spread": 0.1}) is not None
