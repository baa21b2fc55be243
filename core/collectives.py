"""Collectives the stages need, no-ops in one process: small reductions for the trainer's
metrics and branch decisions, a barrier, and the row gather (with gradient) that the
gathering boundary (``pretrain/distributed``) and feature extraction build on."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


def active(group: dist.ProcessGroup | None = None) -> bool:
    """True inside a process group of more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def rank_and_world(group: dist.ProcessGroup | None = None) -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def totals_over_ranks(values: dict[str, float], device: torch.device) -> dict[str, float]:
    """Sum scalars over ranks (one all-reduce for all of them)."""
    if not active() or not values:
        return {k: float(v) for k, v in values.items()}
    packed = torch.tensor([float(v) for v in values.values()], dtype=torch.float64,
                          device=device)
    dist.all_reduce(packed)
    return dict(zip(values, packed.tolist(), strict=True))


def mean_over_ranks(values: dict[str, float], device: torch.device) -> dict[str, float]:
    """Average scalar metrics over ranks (one all-reduce for all of them)."""
    world = dist.get_world_size() if active() else 1
    return {k: v / world for k, v in totals_over_ranks(values, device).items()}


def mean_over_ranks_on_device(value: Tensor) -> Tensor:
    """[] the mean of a scalar tensor over ranks, left on the device (no host sync)."""
    value = value.detach().float().reshape(1).clone()
    if active():
        dist.all_reduce(value)
        value /= dist.get_world_size()
    return value[0]


def sum_over_ranks(value: float, device: torch.device) -> float:
    if not active():
        return float(value)
    total = torch.tensor([float(value)], dtype=torch.float64, device=device)
    dist.all_reduce(total)
    return float(total)


def all_ranks_agree(flag: bool, device: torch.device) -> bool:
    """True when ``flag`` is true on every rank (so all ranks take the same branch)."""
    if not active():
        return flag
    value = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return bool(value.item() > 0)


def barrier() -> None:
    if active():
        dist.barrier()


def row_counts(local: Tensor, group: dist.ProcessGroup | None = None,
               device: torch.device | None = None) -> list[int]:
    """Every rank's number of rows of ``local``, in rank order (exchanged on ``device``,
    default ``local``'s: the device the group's backend takes)."""
    count = torch.tensor([local.shape[0]], device=device or local.device)
    counts = [torch.zeros_like(count) for _ in range(dist.get_world_size(group))]
    dist.all_gather(counts, count, group=group)
    return [int(c) for c in counts]


def _gather_padded(local: Tensor, counts: list[int], group: dist.ProcessGroup | None) -> Tensor:
    padded = local.new_zeros((max(counts), *local.shape[1:]))
    padded[: local.shape[0]] = local
    parts = [torch.empty_like(padded) for _ in counts]
    dist.all_gather(parts, padded.contiguous(), group=group)
    return torch.cat([part[:count] for part, count in zip(parts, counts, strict=True)])


class _GatherWithGrad(torch.autograd.Function):
    """[n_r, ...] per rank -> [sum n_r, ...]; backward sums over ranks, keeps own rows."""

    @staticmethod
    def forward(ctx, local: Tensor, counts: list[int], rank: int,
                group: dist.ProcessGroup | None) -> Tensor:
        ctx.rows = (sum(counts[:rank]), sum(counts[: rank + 1]))
        ctx.group = group
        return _gather_padded(local, counts, group)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None, None]:
        grad = grad.contiguous()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        start, stop = ctx.rows
        return grad[start:stop], None, None, None


def gather_rows(local: Tensor, counts: list[int], group: dist.ProcessGroup | None = None,
                ) -> Tensor:
    """Every rank's rows (``counts`` of them, see :func:`row_counts`) in rank order.

    Differentiable when ``local`` requires grad: the backward sums the gradient of the
    gathered rows over ranks and hands each rank its own slice, so a rank's rows receive
    the gradient from every rank's use of them. Uneven counts are padded for the
    collective and the padding dropped.
    """
    if local.requires_grad:
        return _GatherWithGrad.apply(local, counts, rank_and_world(group)[0], group)
    return _gather_padded(local, counts, group)


def all_gather_rows(local: Tensor, group: dist.ProcessGroup | None = None) -> Tensor:
    """Concatenate every rank's rows in rank order; ``local`` itself in one process."""
    if not active(group):
        return local
    return gather_rows(local, row_counts(local, group), group)


def gather_rows_to_main(local: Tensor, device: torch.device, chunk_rows: int) -> Tensor | None:
    """On rank 0: every rank's rows of ``local`` [n_r, ...] in rank order, on the CPU; on
    the other ranks: None. Rows travel through ``device`` ``chunk_rows`` at a time: a CUDA
    group (NCCL) takes device tensors only, and the chunk bounds the device memory (rank 0
    receives ``world`` chunks at once). No rank but 0 ever holds more than its own rows."""
    if not active():
        return local.cpu()
    rank, world = rank_and_world()
    counts = row_counts(local, device=device)
    received: list[list[Tensor]] = [[] for _ in range(world)]
    for start in range(0, max(counts), chunk_rows):
        piece = torch.zeros((chunk_rows, *local.shape[1:]), dtype=local.dtype, device=device)
        mine = local[start:start + chunk_rows]
        piece[: len(mine)] = mine.to(device)
        parts = [torch.empty_like(piece) for _ in range(world)] if rank == 0 else None
        dist.gather(piece, parts, dst=0)
        if parts is not None:
            for r, part in enumerate(parts):
                received[r].append(part[: max(0, min(chunk_rows, counts[r] - start))].cpu())
    if rank != 0:
        return None
    empty = local.new_zeros((0, *local.shape[1:]), device="cpu")
    return torch.cat([torch.cat(chunks) if chunks else empty for chunks in received])


def gather_objects_to_main(items: list) -> list | None:
    """On rank 0: every rank's list concatenated in rank order; on the others: None."""
    if not active():
        return items
    rank, world = rank_and_world()
    parts: list[list] | None = [[] for _ in range(world)] if rank == 0 else None
    dist.gather_object(items, parts, dst=0)
    return None if parts is None else [item for part in parts for item in part]
