"""Small float64 batches with repeated labels, anchors without positives and odd D."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch import Tensor


@dataclass
class Batch:
    z: Tensor  # [N, D] leaf, float64, requires grad
    ids: Tensor  # [N]
    labels: Tensor  # [N]
    captions: Tensor  # [N, E], identical for the views of one image
    text: Tensor  # [N, D]

    def grad_of(self, loss: Tensor) -> Tensor:
        return torch.autograd.grad(loss, self.z)[0]


def make_multiview_batch(seed: int = 0, dim: int = 7, caption_dim: int = 11) -> Batch:
    """8 images x 2 views plus 3 single-view images, rows shuffled.

    Class 2 has one image (its only label positive is its other view); labels 4 and 5 are
    single-view singletons (no positive at all); one single view carries label 0 (label
    positives, no instance positive).
    """
    gen = torch.Generator().manual_seed(seed)
    image_labels = torch.tensor([0, 0, 1, 1, 1, 2, 3, 3])
    ids = torch.cat([torch.arange(8).repeat_interleave(2), torch.tensor([8, 9, 10])])
    labels = torch.cat([image_labels.repeat_interleave(2), torch.tensor([4, 0, 5])])
    order = torch.randperm(len(ids), generator=gen)
    ids, labels = ids[order], labels[order]
    z = torch.randn(len(ids), dim, generator=gen, dtype=torch.float64).requires_grad_()
    captions = torch.randn(11, caption_dim, generator=gen, dtype=torch.float64)[ids]
    text = torch.randn(len(ids), dim, generator=gen, dtype=torch.float64)
    return Batch(z, ids, labels, captions, text)


@pytest.fixture(params=[0, 1], ids=["seed0", "seed1"])
def batch(request: pytest.FixtureRequest) -> Batch:
    return make_multiview_batch(seed=request.param)
