"""Linear probe on frozen backbone features: multinomial logistic regression (standardised
features, AdamW with cosine decay, full training set per epoch in mini-batches)."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


def linear_probe(train: Tensor, train_labels: Tensor, test: Tensor, test_labels: Tensor,
                 num_classes: int, epochs: int, lr: float, batch_size: int = 1024,
                 seed: int = 0, device: torch.device | None = None) -> dict[str, float]:
    """Top-1 of a linear classifier trained on ``train`` [n, F] and tested on ``test``."""
    device = device or train.device
    gen = torch.Generator().manual_seed(seed)
    mean, std = train.mean(0), train.std(0).clamp(min=1e-6)
    x = ((train - mean) / std).to(device)
    xt = ((test - mean) / std).to(device)
    y, yt = train_labels.long().to(device), test_labels.long().to(device)
    torch.manual_seed(seed)
    head = nn.Linear(x.shape[1], num_classes).to(device)
    optimizer = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=1e-4)
    steps = epochs * math.ceil(len(x) / batch_size)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps)
    for _ in range(epochs):
        for rows in torch.randperm(len(x), generator=gen).split(batch_size):
            rows = rows.to(device)
            loss = nn.functional.cross_entropy(head(x[rows]), y[rows])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
    with torch.no_grad():
        train_acc = (head(x).argmax(1) == y).float().mean()
        test_acc = (head(xt).argmax(1) == yt).float().mean()
    return {"top1": float(test_acc), "train_top1": float(train_acc)}
