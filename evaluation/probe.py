"""Linear probe on frozen backbone features: multinomial logistic regression on
standardised features, AdamW with cosine decay, the full training set per epoch in
mini-batches (the linear evaluation protocol of SimCLR, Chen et al. 2020, with Adam in place
of LARS).

The features stay where they are (the bank's files, read a mini-batch of rows at a time,
or a tensor); each mini-batch is standardised on its way to ``device``, so no standardised
copy of the bank is made and the classifier trains on the run's device.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

MOMENT_BLOCK_ROWS = 65536  # rows per block of the mean and variance passes


def feature_moments(x: Tensor, block_rows: int = MOMENT_BLOCK_ROWS) -> tuple[Tensor, Tensor]:
    """([F] mean, [F] unbiased standard deviation) of ``x`` [n, F], in float64, from two
    passes over row blocks (the mean, then the squared deviations from it)."""
    n = x.shape[0]
    total = torch.zeros(x.shape[1], dtype=torch.float64)
    for start in range(0, n, block_rows):
        total += x[start:start + block_rows].double().sum(0)
    mean = total / n
    squares = torch.zeros_like(mean)
    for start in range(0, n, block_rows):
        squares += (x[start:start + block_rows].double() - mean).square().sum(0)
    return mean, (squares / max(1, n - 1)).sqrt()


class Standardise:
    """Rows of a feature matrix, standardised by the training set's moments, on ``device``."""

    def __init__(self, train: Tensor, device: torch.device) -> None:
        mean, std = feature_moments(train)
        self.mean = mean.float().to(device)
        self.std = std.float().clamp(min=1e-6).to(device)
        self.device = device

    def __call__(self, x: Tensor, rows: Tensor | slice) -> Tensor:
        """[len(rows), F] float32 standardised rows of ``x`` on the device."""
        return (x[rows].to(self.device, torch.float32, non_blocking=True) - self.mean) / self.std


@torch.no_grad()
def accuracy(head: nn.Module, features: Tensor, labels: Tensor, standardise: Standardise,
             batch_size: int) -> float:
    """Top-1 of ``head`` on ``features`` [n, F] in batches (one read of the count)."""
    correct = torch.zeros((), dtype=torch.long, device=standardise.device)
    for start in range(0, features.shape[0], batch_size):
        rows = slice(start, start + batch_size)
        predicted = head(standardise(features, rows)).argmax(1)
        correct += (predicted == labels[rows].to(standardise.device)).sum()
    return int(correct) / max(1, features.shape[0])


def linear_probe(train: Tensor, train_labels: Tensor, test: Tensor, test_labels: Tensor,
                 num_classes: int, epochs: int, lr: float, batch_size: int = 1024,
                 seed: int = 0, device: torch.device | None = None) -> dict[str, float]:
    """Top-1 of a linear classifier trained on ``train`` [n, F] (labels [n]) and tested on
    ``test`` [m, F] (labels [m]), trained on ``device`` (default: where ``train`` is)."""
    device = device or train.device
    standardise = Standardise(train, device)
    gen = torch.Generator().manual_seed(seed)  # the order does not depend on the device
    torch.manual_seed(seed)
    head = nn.Linear(train.shape[1], num_classes).to(device)
    optimizer = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=1e-4)
    steps = epochs * math.ceil(len(train) / batch_size)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps)
    for _ in range(epochs):
        for rows in torch.randperm(len(train), generator=gen).split(batch_size):
            logits = head(standardise(train, rows))
            loss = nn.functional.cross_entropy(logits, train_labels[rows].long().to(device))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
    return {"top1": accuracy(head, test, test_labels, standardise, batch_size),
            "train_top1": accuracy(head, train, train_labels, standardise, batch_size)}
