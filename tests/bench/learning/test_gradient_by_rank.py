"""The gradient allocation of bench.learning.gradient_by_rank against autograd through the
losses themselves (float64): CLIP's image-to-text cross-entropy and SigLIP's pairwise
sigmoid loss."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from bench.learning.gradient_by_rank import allocation, row_weights


def similarities(n: int = 12) -> torch.Tensor:
    torch.manual_seed(0)
    images = F.normalize(torch.randn(n, 8, dtype=torch.float64), dim=1)
    texts = F.normalize(images + 0.7 * torch.randn(n, 8, dtype=torch.float64), dim=1)
    return images @ texts.T


def test_the_weights_are_the_losses_gradients_per_unit_of_scale():
    s = similarities().requires_grad_()
    n, scale, bias = len(s), 14.0, -6.0
    eye = torch.eye(n, dtype=torch.bool)
    for b in (None, bias):
        if b is None:  # CLIP, image to text: sum over rows of cross-entropy
            loss = F.cross_entropy(scale * s, torch.arange(n), reduction="sum")
        else:  # SigLIP: softplus(-z (t s + b)), z = +1 on the diagonal, -1 elsewhere
            z = 2 * eye.double() - 1
            loss = F.softplus(-z * (scale * s + b)).sum()
        (grad,) = torch.autograd.grad(loss, s)
        pull, push = row_weights(s.detach(), scale, b)
        torch.testing.assert_close(-grad.diagonal() / scale, pull)
        torch.testing.assert_close((grad / scale).masked_fill(eye, 0), push)


def test_the_allocation_splits_rows_by_the_positives_rank():
    s = similarities().detach()
    result = allocation(s, 10.0, None)
    pull, push = row_weights(s, 10.0, None)
    first = [i for i in range(len(s)) if all(s[i, j] <= s[i, i] for j in range(len(s)))]
    lower = [i for i in range(len(s)) if i not in first]
    assert first and lower  # the fixture has both kinds of rows
    assert result["rows_ranked_first"] == len(first) / len(s)
    assert abs(result["pull_ranked_first"] - pull[first].mean().item()) < 1e-12
    assert abs(result["pull_ranked_lower"] - pull[lower].mean().item()) < 1e-12
    above = sum(push[i, j].item() for i in range(len(s)) for j in range(len(s))
                if s[i, j] > s[i, i])
    assert abs(result["push_share_above"] - above / push.sum().item()) < 1e-12
