"""Functions the 2-rank gloo group runs for the collectives' tests."""

from __future__ import annotations

import torch
import torch.distributed as dist

from core.collectives import all_gather_rows, all_ranks_agree, mean_over_ranks, sum_over_ranks


def gather_rows_on_rank() -> dict:
    """Uneven all-gather of rows with gradient; backward sums every rank's use of a row."""
    rank = dist.get_rank()
    local = torch.full((rank + 2, 3), float(rank + 1), requires_grad=True)
    gathered = all_gather_rows(local)
    weights = torch.arange(gathered.numel(), dtype=gathered.dtype).view_as(gathered)
    (gathered * weights * (rank + 1)).sum().backward()
    return {"gathered": gathered.detach(), "grad": local.grad}


def reductions_on_rank() -> dict:
    rank = dist.get_rank()
    cpu = torch.device("cpu")
    return {"mean": mean_over_ranks({"a": float(rank), "b": 2.0 * rank}, cpu),
            "sum": sum_over_ranks(rank + 1, cpu),
            "agree_all": all_ranks_agree(True, cpu),
            "agree_one": all_ranks_agree(rank == 0, cpu)}
