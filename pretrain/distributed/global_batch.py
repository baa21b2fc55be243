"""The gathering boundary: builds each rank's view of the global batch (SPEC section 4).

Embeddings are gathered with gradient: the backward of the gather all-reduces (sums) the
gradient of the gathered rows and hands each rank its own slice, so a rank's samples
receive the gradient from every rank's anchors. Ids, labels and caption embeddings are
gathered without gradient. Ranks may hold different numbers of samples (rows are padded
for the collective and the padding dropped). Each rank's anchors are its own rows; the
objective's per-rank mean is scaled by the world size over the global anchor count, so
gradient averaging across ranks (DDP, DeepSpeed) gives exactly the gradient of the
global-batch loss. Shared scalars such as a learnable temperature are not touched here:
their gradients are averaged once by the engine.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from pretrain.losses.batch import ContrastiveBatch, make_batch


def _world(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _row_counts(local: Tensor, group: dist.ProcessGroup | None, world: int) -> list[int]:
    count = torch.tensor([local.shape[0]], device=local.device)
    counts = [torch.zeros_like(count) for _ in range(world)]
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


def all_gather_rows(local: Tensor, group: dist.ProcessGroup | None = None) -> Tensor:
    """Concatenate every rank's rows in rank order; differentiable when ``local`` is."""
    rank, world = _world(group)
    if world == 1:
        return local
    counts = _row_counts(local, group, world)
    if local.requires_grad:
        return _GatherWithGrad.apply(local, counts, rank, group)
    return _gather_padded(local, counts, group)


def build_global_batch(
    z: Tensor,
    ids: Tensor,
    labels: Tensor | None = None,
    captions: Tensor | None = None,
    text: Tensor | None = None,
    class_graph: Tensor | None = None,
    num_negatives: int | None = None,
    negatives_seed: int = 0,
    group: dist.ProcessGroup | None = None,
) -> ContrastiveBatch:
    """This rank's :class:`ContrastiveBatch` over the global batch.

    Args are this rank's local rows: ``z`` [n, D] embeddings (un-normalised), ``ids`` [n]
    globally unique instance ids, ``labels`` [n], ``captions`` [n, E], ``text`` [n, D].
    ``class_graph`` [C, C] is the same on every rank. Without a process group (or with
    one rank) this is :func:`pretrain.losses.make_batch`.
    """
    rank, world = _world(group)
    if world == 1:
        return make_batch(z, ids, labels=labels, captions=captions, class_graph=class_graph,
                          text=text, num_negatives=num_negatives, negatives_seed=negatives_seed)
    counts = _row_counts(z, group, world)
    start = sum(counts[:rank])

    def gather(x: Tensor | None, normalize: bool = False) -> Tensor | None:
        if x is None:
            return None
        x = F.normalize(x, dim=1) if normalize else x
        if x.requires_grad:
            return _GatherWithGrad.apply(x, counts, rank, group)
        return _gather_padded(x, counts, group)

    return ContrastiveBatch(
        candidates=gather(z, normalize=True),
        anchor_index=torch.arange(start, start + z.shape[0], device=z.device),
        ids=gather(ids),
        labels=gather(labels),
        captions=gather(captions, normalize=True),
        class_graph=class_graph,
        text=gather(text, normalize=True),
        num_negatives=num_negatives,
        negatives_seed=negatives_seed,
        world_size=world,
    )
