"""Collapse detection: the effective rank against its definition, the watch's verdicts on
metric rows, and a run that shows collapse warns and then stops with the advice."""

from __future__ import annotations

import math

import pytest
import torch

from pretrain.collapse import CollapseConfig, Collapsed, CollapseWatch, effective_rank
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
