"""The gathering boundary: builds each rank's view of the global batch.

Embeddings are gathered with gradient (:func:`core.collectives.gather_rows`): the backward
sums the gradient of the gathered rows over ranks and hands each rank its own slice, so a
rank's samples receive the gradient from every rank's anchors. Ids, labels and caption
embeddings are gathered without gradient. Ranks may hold different numbers of samples.
Each rank's anchors are its own rows; the objective's per-rank mean is scaled by the world
size over the global anchor count, so gradient averaging across ranks (DDP, DeepSpeed)
gives exactly the gradient of the global-batch loss (``docs/objectives.md``, "Distributed
semantics"). Shared scalars such as a learnable temperature are not touched here: their
gradients are averaged once by the engine.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from core.collectives import active, gather_rows, rank_and_world, row_counts
from pretrain.losses.batch import (
    BatchOptions,
    BatchRows,
    ContrastiveBatch,
    auto_tile_size,
    local_batch,
)


def build_global_batch(rows: BatchRows, options: BatchOptions | None = None,
                       group: dist.ProcessGroup | None = None) -> ContrastiveBatch:
    """This rank's :class:`ContrastiveBatch` over the global batch.

    ``rows`` are this rank's local rows (:class:`BatchRows`; ``ids`` globally unique);
    ``options.class_graph`` is the same on every rank. Without a process group (or with
    one rank) this is :func:`pretrain.losses.batch.local_batch`. ``options.tile_size``
    None chooses dense or tiled from the global batch size
    (:func:`pretrain.losses.batch.auto_tile_size`).
    """
    options = options or BatchOptions()
    if not active(group):
        return local_batch(rows, options)
    rank, world = rank_and_world(group)
    counts = row_counts(rows.z, group)
    start = sum(counts[:rank])

    def gather(x: Tensor | None, normalize: bool = False) -> Tensor | None:
        if x is None:
            return None
        return gather_rows(F.normalize(x, dim=1) if normalize else x, counts, group)

    return ContrastiveBatch(
        candidates=gather(rows.z, normalize=True),
        anchor_index=torch.arange(start, start + rows.z.shape[0], device=rows.z.device),
        ids=gather(rows.ids),
        labels=gather(rows.labels),
        captions=gather(rows.captions, normalize=True),
        class_graph=options.class_graph,
        text=gather(rows.text, normalize=True),
        num_negatives=options.num_negatives,
        negatives_seed=options.negatives_seed,
        tile_size=auto_tile_size(options.tile_size, sum(counts)),
        world_size=world,
        num_classes=options.num_classes,
    )
