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

from pretrain.contrast.batch import ContrastiveBatch
from pretrain.objectives import objective_function
from tests.objective_cases import case_ids, objective_cases
from tests.pretrain.objectives.batches import batch_of
from tests.pretrain.objectives.conftest import make_multiview_batch

CASES = objective_cases()


@pytest.mark.parametrize("case", CASES, ids=case_ids(CASES))
@pytest.mark.parametrize("num_negatives", [None, 5])
def test_ranks_average_to_the_whole_batch(case, num_negatives):
    b = make_multiview_batch(seed=4)
    rows = case.rows(b.z, b.ids, b.labels, b.captions, b.text)
    keywords = case.keywords(6, b.z.shape[1], torch.float64)
    graph = keywords.pop("class_graph", None)
    tau = torch.tensor(0.2, dtype=torch.float64, requires_grad=True)
    objective = objective_function(case.name, **keywords)
    whole = objective(batch_of(rows.z, rows.ids, rows.labels, rows.captions, graph, rows.text,
                               num_negatives=num_negatives, negatives_seed=7), tau)
    want = torch.autograd.grad(whole.loss, [b.z, tau])

    unit = {k: None if v is None else F.normalize(v, dim=1)
            for k, v in (("captions", rows.captions), ("text", rows.text))}
    slices = [torch.arange(0, 6), torch.arange(6, 19)]  # uneven ranks
    losses, grads = [], [torch.zeros_like(b.z), torch.zeros_like(tau)]
    for anchors in slices:
        local = ContrastiveBatch(
            candidates=F.normalize(b.z, dim=1), anchor_index=anchors, ids=b.ids,
            labels=rows.labels, class_graph=graph, num_negatives=num_negatives,
            negatives_seed=7, world_size=len(slices), **unit)
        out = objective(local, tau)
        losses.append(out.loss)
        for acc, g in zip(grads, torch.autograd.grad(out.loss, [b.z, tau]), strict=True):
            acc += g / len(slices)
    torch.testing.assert_close(sum(losses) / len(slices), whole.loss, rtol=1e-12, atol=1e-12)
    for got, expected in zip(grads, want, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
