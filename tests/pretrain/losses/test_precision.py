"""Finite losses and gradients at tau = 0.01 under bf16 autocast."""

from __future__ import annotations

import pytest
import torch

from pretrain.losses import OBJECTIVES, batch_loss

HPARAMS = {"projnce": [{"projection": p} for p in ("centroid", "kernel", "median", "learned")]}


def cases():
    for name in OBJECTIVES:
        for hp in HPARAMS.get(name, [{}]):
            yield pytest.param(name, hp, id=f"{name}-{hp.get('projection', '')}".rstrip("-"))


@pytest.mark.parametrize(("name", "hparams"), list(cases()))
def test_finite_at_tau_001_under_bf16_autocast(name, hparams):
    gen = torch.Generator().manual_seed(0)
    n_images, dim = 64, 32
    ids = torch.arange(n_images).repeat_interleave(2)
    labels = ids % 5
    encoder = torch.nn.Linear(48, dim)
    x = torch.randn(len(ids), 48, generator=gen)
    captions = torch.randn(n_images, 24, generator=gen)[ids].half()
    text = torch.randn(len(ids), dim, generator=gen)
    table = torch.randn(5, dim, requires_grad=True)
    if hparams.get("projection") == "learned":
        hparams = {**hparams, "class_embeddings": table}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        z = encoder(x)
        assert z.dtype == torch.bfloat16
        loss, metrics = batch_loss(name, z, ids, labels, captions=captions, text=text,
                                   temperature=0.01, **hparams)
    loss.backward()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(v) for v in metrics.values()), metrics
    assert torch.isfinite(encoder.weight.grad).all()
    assert encoder.weight.grad.abs().sum() > 0
    with torch.no_grad():
        reference, _ = batch_loss(name, encoder(x).double(), ids, labels,
                                  captions=captions.double(), text=text.double(),
                                  temperature=0.01, **hparams)
    # The loss math runs in float32; only the encoder ran in bf16.
    assert abs(loss.item() - reference.item()) < 0.05 * max(1.0, abs(reference.item()))
