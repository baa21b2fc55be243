"""2 gloo ranks with different, uneven data reproduce one process on the whole batch:
the same loss (mean over ranks), the same metrics and the same gradients, for every
objective."""

from __future__ import annotations

import pytest
import torch

from pretrain.objectives import objective_function
from tests.objective_cases import case_ids, objective_cases
from tests.pretrain.distributed import rank_tasks
from tests.pretrain.objectives.batches import batch_of
from tests.pretrain.objectives.conftest import make_multiview_batch

CASES = objective_cases()


@pytest.mark.parametrize("tile_size", [None, 5], ids=["dense", "tiled"])
@pytest.mark.parametrize("num_negatives", [None, 5])
@pytest.mark.parametrize("case", CASES, ids=case_ids(CASES))
def test_two_ranks_equal_one_process(gloo2, case, num_negatives, tile_size):
    """Each rank's tiles (when on) against the dense single process."""
    ranks = gloo2.run(rank_tasks.objective_on_rank, case, num_negatives, tile_size)
    b = make_multiview_batch(seed=4)
    tau = torch.tensor(0.2, dtype=torch.float64, requires_grad=True)
    text = b.text.detach().clone().requires_grad_()
    keywords, params = rank_tasks.case_keywords(case)
    rows = case.rows(b.z, b.ids, b.labels, b.captions, text)
    graph = keywords.pop("class_graph", None)
    whole = objective_function(case.name, **keywords)(
        batch_of(rows.z, rows.ids, rows.labels, rows.captions, graph,
                 rows.text, num_negatives=num_negatives, negatives_seed=7), tau)
    grad_z, grad_tau, grad_text, *grad_params = torch.autograd.grad(
        whole.loss, [b.z, tau, text, *params], allow_unused=True)
    world = len(ranks)
    if grad_text is not None:  # the second modality's gradient crosses the boundary too
        got_text = torch.cat([r["grad_text"] for r in ranks]) / world
        torch.testing.assert_close(got_text, grad_text, rtol=1e-10, atol=1e-12)
    for index, want in enumerate(grad_params):
        torch.testing.assert_close(sum(r["grad_params"][index] for r in ranks) / world, want,
                                   rtol=1e-10, atol=1e-12)
    # DDP averages gradients over ranks; per-rank losses average to the global loss.
    torch.testing.assert_close(sum(r["loss"] for r in ranks) / world, whole.loss.detach(),
                               rtol=1e-12, atol=1e-12)
    got_z = torch.cat([r["grad_z"] for r in ranks]) / world
    torch.testing.assert_close(got_z, grad_z, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(sum(r["grad_tau"] for r in ranks) / world, grad_tau,
                               rtol=1e-10, atol=1e-12)
    for key, value in whole.metrics.items():
        if key == "temperature":
            continue
        mean = sum(r["metrics"][key] for r in ranks) / world
        torch.testing.assert_close(mean, value.detach(), rtol=1e-9, atol=1e-12, msg=key)
