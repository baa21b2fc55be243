"""Functions the 2-rank gloo group runs (importable, so the spawned workers can load them)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from pretrain.distributed import build_global_batch
from pretrain.objectives import BatchOptions, objective_function
from tests.objective_cases import ObjectiveCase
from tests.pretrain.objectives.conftest import make_multiview_batch

SPLIT = 6  # rank 0 holds rows [0, 6), rank 1 rows [6, 19): uneven and asymmetric
ROWS_PER_RANK = 16  # every rank gathers 16 rows: rank 0 pads 10, rank 1 pads 3


def local_rows(n: int) -> slice:
    return slice(0, SPLIT) if dist.get_rank() == 0 else slice(SPLIT, n)


def objective_on_rank(case: ObjectiveCase, num_negatives: int | None,
                      tile_size: int | None = None) -> dict:
    """Loss, metrics and gradients of this rank's share of the fixed test batch."""
    b = make_multiview_batch(seed=4)
    rows = local_rows(len(b.ids))
    z = b.z.detach()[rows].clone().requires_grad_()
    text = b.text.detach()[rows].clone().requires_grad_()
    tau = torch.tensor(0.2, dtype=torch.float64, requires_grad=True)
    keywords, params = case_keywords(case)
    batch = build_global_batch(
        case.rows(z, b.ids[rows], b.labels[rows], b.captions[rows], text),
        BatchOptions(keywords.pop("class_graph", None), num_negatives=num_negatives,
                     negatives_seed=7, tile_size=tile_size, rows_per_rank=ROWS_PER_RANK))
    out = objective_function(case.name, **keywords)(batch, tau)
    grad_z, grad_tau, grad_text, *grad_params = torch.autograd.grad(
        out.loss, [z, tau, text, *params], allow_unused=True)
    return {"loss": out.loss.detach(), "grad_z": grad_z, "grad_tau": grad_tau,
            "grad_text": grad_text, "grad_params": grad_params,
            "metrics": {k: v.detach() for k, v in out.metrics.items()}}


def case_keywords(case: ObjectiveCase) -> tuple[dict, list[torch.Tensor]]:
    """The case's keywords, its learnable loss parameters (siglip's bias, projnce's class
    embeddings) made leaves that require a gradient, and those leaves."""
    keywords = case.keywords(6, 7, torch.float64)
    params = case.parameter_leaves(keywords)
    return keywords, params
