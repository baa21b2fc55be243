"""The gathering boundary: builds each rank's view of the global batch.

Every rank contributes a fixed number of rows R (``BatchOptions.rows_per_rank``: the views
of its configured batch; its own rows when unset): a rank holding fewer pads its rows with
zeros, and a validity mask travels with the ids and labels, so the gather has one shape on
every rank and no count is exchanged or read back to the host. Embeddings are gathered with
gradient (:func:`core.collectives.gather_rows`): the backward sums the gradient of the
gathered rows over ranks and hands each rank its own slice, so a rank's samples receive the
gradient from every rank's anchors. Ids, labels, the mask and caption embeddings are
gathered without gradient. Each rank's anchors are its own (valid) rows; the objective's
per-rank mean is scaled by the world size over the global anchor count, so gradient
averaging across ranks (DDP, DeepSpeed) gives exactly the gradient of the global-batch loss
(``docs/objectives.md``, "Distributed semantics"). Shared scalars such as a learnable
temperature are not touched here: their gradients are averaged once by the engine.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from core.collectives import active, gather_rows, rank_and_world
from pretrain.contrast.batch import (
    BatchOptions,
    BatchRows,
    ContrastiveBatch,
    auto_tile_size,
    local_batch,
    unit_rows,
)


def build_global_batch(rows: BatchRows, options: BatchOptions | None = None,
                       group: dist.ProcessGroup | None = None) -> ContrastiveBatch:
    """This rank's :class:`ContrastiveBatch` over the global batch.

    ``rows`` are this rank's local rows (:class:`BatchRows`; ``ids`` globally unique);
    ``options.class_graph`` is the same on every rank. Without a process group (or with
    one rank) this is :func:`pretrain.contrast.batch.local_batch`. ``options.tile_size``
    None chooses dense or tiled from the global batch size
    (:func:`pretrain.contrast.batch.auto_tile_size`).
    """
    options = options or BatchOptions()
    if not active(group):
        return local_batch(rows, options)
    rank, world = rank_and_world(group)
    n = rows.z.shape[0]
    width = options.rows_per_rank or n
    if n > width:
        raise ValueError(f"a rank holds {n} rows, more than rows_per_rank={width}")
    counts = [width] * world  # known on every rank: nothing is exchanged

    def gather(x: Tensor | None, normalize: bool = False) -> Tensor | None:
        if x is None:
            return None
        x = unit_rows(x) if normalize else x
        return gather_rows(F.pad(x, (0, 0) * (x.dim() - 1) + (0, width - n)), counts, group)

    device = rows.z.device
    labels = torch.zeros_like(rows.ids) if rows.labels is None else rows.labels
    # [R * world, 3]: id, label and 1 for a real row (padding rows are all 0)
    keys = gather(torch.stack([rows.ids, labels.to(rows.ids.dtype),
                               torch.ones_like(rows.ids)], dim=1))
    return ContrastiveBatch(
        candidates=gather(rows.z, normalize=True),
        anchor_index=torch.arange(rank * width, rank * width + n, device=device),
        anchor_start=rank * width,
        ids=keys[:, 0],
        labels=None if rows.labels is None else keys[:, 1],
        captions=gather(rows.captions),
        class_graph=options.class_graph,
        text=gather(rows.text, normalize=True),
        num_negatives=options.num_negatives,
        negatives_seed=options.negatives_seed,
        tile_size=auto_tile_size(options.tile_size, width * world),
        world_size=world,
        num_classes=options.num_classes,
        valid=keys[:, 2].bool(),
    )
