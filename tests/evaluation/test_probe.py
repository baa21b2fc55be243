"""The linear probe against a reference that standardises a full copy of the features
(how the probe worked before it standardised per batch), its moments against torch's, and
its device logic in the CUDA dry run."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from torch import nn

from evaluation.probe import feature_moments, linear_probe
from tests.cuda_dry_run import fake_cuda


def reference_probe(train, train_labels, test, test_labels, num_classes, epochs, lr,
                    batch_size, seed):
    """Standardise whole copies (torch's mean and std), then the same training loop."""
    mean = train.double().mean(0).float()
    std = train.double().std(0).float().clamp(min=1e-6)
    x, xt = (train - mean) / std, (test - mean) / std
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    head = nn.Linear(x.shape[1], num_classes)
    optimizer = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=1e-4)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(
        optimizer, epochs * math.ceil(len(x) / batch_size))
    for _ in range(epochs):
        for rows in torch.randperm(len(x), generator=gen).split(batch_size):
            loss = nn.functional.cross_entropy(head(x[rows]), train_labels[rows])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
    with torch.no_grad():
        return {"top1": float((head(xt).argmax(1) == test_labels).float().mean()),
                "train_top1": float((head(x).argmax(1) == train_labels).float().mean())}


def clusters(n: int, classes: int, dim: int, seed: int, spread: float = 1.5):
    """Gaussian classes around off-centre, unscaled means (standardisation matters)."""
    gen = torch.Generator().manual_seed(seed)
    centres = torch.randn(classes, dim, generator=gen) * 3 + 5
    labels = torch.arange(n) % classes
    return centres[labels] + spread * torch.randn(n, dim, generator=gen), labels


def test_feature_moments_in_blocks_equal_torchs():
    x, _ = clusters(1000, 4, 7, seed=0)
    x = x.double() * torch.linspace(0.01, 100, 7, dtype=torch.float64)
    mean, std = feature_moments(x, block_rows=64)
    torch.testing.assert_close(mean, x.mean(0), rtol=1e-12, atol=0)
    torch.testing.assert_close(std, x.std(0), rtol=1e-12, atol=0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_probe_matches_a_probe_on_standardised_copies(seed):
    x, labels = clusters(900, 5, 12, seed)
    train, train_labels, test, test_labels = x[:600], labels[:600], x[600:], labels[600:]
    got = linear_probe(train, train_labels, test, test_labels, 5, epochs=4, lr=0.1,
                       batch_size=64, seed=seed)
    want = reference_probe(train, train_labels, test, test_labels, 5, 4, 0.1, 64, seed)
    # the same arithmetic per element; the moments may differ in the last bit (float64
    # blocks against torch's reduction), far below what moves a prediction here
    assert got == pytest.approx(want, abs=1 / 300)
    assert got["top1"] > 0.9


class Stop(Exception):  # noqa: N818 (the end of the recorded step, not an error)
    """Raised after the first loss: what the step saw is all the test needs."""


def loss_devices(monkeypatch, device: torch.device | None, fake: bool) -> list[tuple]:
    """The devices of the logits, the labels and the head's weight at the probe's first
    loss, trained for ``device`` (on fake CUDA tensors when ``fake``)."""
    train, train_labels = clusters(64, 3, 8, seed=0)
    seen = []

    def record(logits, target, *args, **kwargs):
        seen.append((logits.device.type, target.device.type))
        raise Stop

    monkeypatch.setattr(nn.functional, "cross_entropy", record)
    with fake_cuda() if fake else contextlib.nullcontext(), pytest.raises(Stop):
        linear_probe(train, train_labels, train, train_labels, 3, epochs=1, lr=0.1,
                     batch_size=16, device=device)
    return seen


def test_the_probe_trains_on_the_run_device(monkeypatch):
    """Every batch moves to the run's device and meets the head there: the first loss
    sees CUDA logits and labels (fake CUDA tensors: a CPU tensor beside them would fail).
    A probe that ignored ``device`` would train on the features' CPU, which the same
    recorder tells apart (the second call)."""
    assert loss_devices(monkeypatch, torch.device("cuda"), fake=True) == [("cuda", "cuda")]
    assert loss_devices(monkeypatch, None, fake=False) == [("cpu", "cpu")]
