"""Per-rank anchor slices of one global batch reproduce the whole-batch loss and gradient.

This is the arithmetic of the distributed path without process groups: rank r computes its rows
against all candidates, scaled by world_size over the global anchor count; averaging the
ranks' losses and gradients must give exactly the single-process result. Uneven slices
and asymmetric data make a gather that keeps only the local slice fail.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pretrain.losses import OBJECTIVES, objective_function
from pretrain.losses.batch import ContrastiveBatch
from tests.pretrain.losses.batches import batch_of
from tests.pretrain.losses.conftest import make_multiview_batch

CASES = [(name, {}) for name in OBJECTIVES if name != "projnce"] + [
    ("projnce", {"projection": p}) for p in ("centroid", "kernel", "median", "learned")]


@pytest.mark.parametrize(("name", "hparams"), CASES,
                         ids=[f"{n}-{h.get('projection', '')}".rstrip("-") for n, h in CASES])
@pytest.mark.parametrize("num_negatives", [None, 5])
def test_ranks_average_to_the_whole_batch(name, hparams, num_negatives):
    b = make_multiview_batch(seed=4)
    if hparams.get("projection") == "learned":
        hparams = {**hparams, "class_embeddings": torch.randn(6, 7, dtype=torch.float64)}
    if hparams.get("projection") == "kernel":
        hparams = {**hparams, "bandwidth": 2.0}
    tau = torch.tensor(0.2, dtype=torch.float64, requires_grad=True)
    objective = objective_function(name, **hparams)
    extras = {"labels": b.labels, "captions": b.captions, "text": b.text,
              "num_negatives": num_negatives, "negatives_seed": 7}
    whole = objective(batch_of(b.z, b.ids, **extras), tau)
    want = torch.autograd.grad(whole.loss, [b.z, tau])

    slices = [torch.arange(0, 6), torch.arange(6, 19)]  # uneven ranks
    losses, grads = [], [torch.zeros_like(b.z), torch.zeros_like(tau)]
    for rows in slices:
        local = ContrastiveBatch(
            candidates=F.normalize(b.z, dim=1), anchor_index=rows, ids=b.ids,
            labels=b.labels, captions=F.normalize(b.captions, dim=1),
            text=F.normalize(b.text, dim=1), num_negatives=num_negatives,
            negatives_seed=7, world_size=len(slices))
        out = objective(local, tau)
        losses.append(out.loss)
        for acc, g in zip(grads, torch.autograd.grad(out.loss, [b.z, tau]), strict=True):
            acc += g / len(slices)
    torch.testing.assert_close(sum(losses) / len(slices), whole.loss, rtol=1e-12, atol=1e-12)
    for got, expected in zip(grads, want, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
