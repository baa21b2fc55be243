"""The objective as a training step calls it (``trainer.loss_of_outputs``, the step's own
path, not the table's ``batch_loss``): in full precision under the step's bf16 autocast,
and refused, naming what is missing, on a batch without what its entry declares."""

from __future__ import annotations

import pytest
import torch

from pretrain.loop.step import Objective
from pretrain.loop.trainer import loss_of_outputs
from pretrain.model.encoder import ModelOutput
from pretrain.objectives import ObjectiveConfig, batch_loss

IDS = torch.arange(16).repeat(2)  # two views of 16 images
LABELS = (IDS % 4)


def bf16_outputs() -> ModelOutput:
    z = torch.randn(32, 8, generator=torch.Generator().manual_seed(0)).bfloat16()
    return ModelOutput(None, z, None, None, {})


@pytest.mark.parametrize("name", ["supcon", "sincere", "infonce"])
def test_the_objective_of_a_step_computes_in_float32_under_bf16_autocast(name):
    """Against the table's call on the same bf16 embeddings outside autocast (held to
    float64 by ``tests/pretrain/objectives/test_precision.py``): the same float32
    arithmetic; with the step's autocast left on, bf16 matmuls move the loss by ~1e-3."""
    out = bf16_outputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = loss_of_outputs(out, {"ids": IDS, "labels": LABELS},
                              Objective(ObjectiveConfig(name=name, temperature=0.2)), step=0,
                              measure_rank=False)
    want = batch_loss(name, out.projections, IDS, LABELS, temperature=0.2)
    assert got.loss.dtype == torch.float32
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-6, atol=1e-6)


def test_a_step_without_the_labels_its_objective_declares_is_refused():
    with pytest.raises(ValueError, match="supcon: needs class labels"):
        loss_of_outputs(bf16_outputs(), {"ids": IDS}, Objective(ObjectiveConfig(name="supcon")),
                        step=0, measure_rank=False)
