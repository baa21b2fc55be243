"""Small collectives the trainer needs besides the global batch; no-ops in one process."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def _active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def mean_over_ranks(values: dict[str, float], device: torch.device) -> dict[str, float]:
    """Average scalar metrics over ranks (one all-reduce for all of them)."""
    if not _active() or not values:
        return dict(values)
    packed = torch.tensor([float(v) for v in values.values()], dtype=torch.float64,
                          device=device)
    dist.all_reduce(packed)
    packed /= dist.get_world_size()
    return dict(zip(values, packed.tolist(), strict=True))


def sum_over_ranks(value: float, device: torch.device) -> float:
    if not _active():
        return float(value)
    total = torch.tensor([float(value)], dtype=torch.float64, device=device)
    dist.all_reduce(total)
    return float(total)


def all_ranks_agree(flag: bool, device: torch.device) -> bool:
    """True when ``flag`` is true on every rank (so all ranks take the same branch)."""
    if not _active():
        return flag
    value = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return bool(value.item() > 0)


def broadcast_object(obj: Any) -> Any:
    if not _active():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier() -> None:
    if _active():
        dist.barrier()
