"""Finite float32 losses and gradients at tau = 0.01 under bf16 autocast."""

from __future__ import annotations

import pytest
import torch

from pretrain.objectives import batch_loss
from tests.objective_cases import case_ids, objective_cases

CASES = objective_cases()
CLASSES = 5


@pytest.mark.parametrize("case", CASES, ids=case_ids(CASES))
def test_finite_at_tau_001_under_bf16_autocast(case):
    gen = torch.Generator().manual_seed(0)
    n_images, dim = 64, 32
    ids = torch.arange(n_images).repeat_interleave(2)
    encoder = torch.nn.Linear(48, dim)
    x = torch.randn(len(ids), 48, generator=gen)
    captions = torch.randn(n_images, 24, generator=gen)[ids].half()
    text = torch.randn(len(ids), dim, generator=gen)
    keywords = case.keywords(CLASSES, dim, torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        z = encoder(x)
        assert z.dtype == torch.bfloat16
        rows = case.rows(z, ids, ids % CLASSES, captions, text)
        loss, metrics = batch_loss(case.name, z, ids, rows.labels, captions=rows.captions,
                                   text=rows.text, temperature=0.01, **keywords)
    loss.backward()
    assert loss.dtype == torch.float32  # the loss arithmetic ran with autocast off
    assert torch.isfinite(loss)
    assert all(torch.isfinite(v) for v in metrics.values()), metrics
    assert torch.isfinite(encoder.weight.grad).all()
    assert encoder.weight.grad.abs().sum() > 0
    with torch.no_grad():
        double = case.rows(encoder(x).double(), ids, ids % CLASSES, captions.double(),
                           text.double())
        reference, _ = batch_loss(case.name, double.z, ids, double.labels,
                                  captions=double.captions, text=double.text,
                                  temperature=0.01, **keywords)
    # The loss math runs in float32; only the encoder ran in bf16.
    assert abs(loss.item() - reference.item()) < 0.05 * max(1.0, abs(reference.item()))
