"""X-CLR's sparse targets (``objective.xclr.top_k``): each anchor keeps the k candidates
whose captions (or classes) are most like its own and gives the others no target mass.

    keep_ij = u_ij >= u_i(k) - tie / tau_s,   u_ij = c_i . c_j / tau_s,  j != i
    t_ij    = softmax over the kept j of u_ij

with u_i(k) the k-th largest u_ij over the anchor's columns (all of them when there are
fewer than k). Candidates within ``tie`` in cosine of the k-th are ties and kept with it:
duplicate captions have equal cosines, and the dense and tiled paths round the same
cosine differently in the last bits, so an exact cut could keep a duplicate on one path
and drop it on the other. Each path finds u_i(k) its own way (a top-k over the row, over
label groups weighted by their members, or tile by tile) and keeps the same columns.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pretrain.contrast.columns import MASKED_LOGIT, ColumnTiles
from pretrain.contrast.tiles import TargetLogits, row_blocks


def keep_top_k_(logits: Tensor, floor: Tensor, tie: float) -> Tensor:
    """Set the target logits [n, T] below each row's ``floor`` [n] (less ``tie``) to
    MASKED_LOGIT, in place."""
    return logits.masked_fill_(logits < (floor - tie)[:, None], MASKED_LOGIT)


def dense_floor(logits: Tensor, k: int) -> Tensor:
    """[n] the k-th largest of each row of ``logits`` [n, N] (masked entries hold
    MASKED_LOGIT); MASKED_LOGIT where a row has fewer than k entries."""
    if logits.shape[1] < k:
        return logits.new_full((logits.shape[0],), MASKED_LOGIT)
    return logits.topk(k, dim=1).values[:, -1]


def group_floor(logits: Tensor, members: Tensor, k: int) -> Tensor:
    """[n] the k-th largest target logit of each row when group g of ``logits`` [n, G]
    stands for ``members`` [n, G] columns of equal logit: the groups sorted by logit, the
    first whose running member count reaches k."""
    values, order = logits.sort(dim=1, descending=True)
    reached = members.gather(1, order).cumsum(1) >= k
    first = reached.to(torch.int8).argmax(1, keepdim=True)  # 0 where it is never reached
    return torch.where(reached.any(1), values.gather(1, first)[:, 0],
                       torch.full_like(values[:, 0], MASKED_LOGIT))


def tiled_floor(targets: TargetLogits, columns: ColumnTiles, n: int, num_columns: int,
                tile_size: int, k: int, like: Tensor) -> Tensor:
    """[n] the k-th largest target logit over each anchor's ``columns``, walking the
    column tiles as the tiled pass does and keeping a running top k ([rows, k + T] at a
    time, no [n, N])."""
    floors = []
    for block in row_blocks(n, tile_size, like.device):
        rows = block.stop - block.start
        best = like.new_empty(rows, 0)
        for start in range(0, num_columns, tile_size):
            stop = min(start + tile_size, num_columns)
            tile = targets(start, stop, block, like.new_empty(rows, stop - start))
            tile = columns.tile(start, stop, block).fill_(tile, MASKED_LOGIT)
            merged = torch.cat([best, tile], dim=1)
            best = merged.topk(min(k, merged.shape[1]), dim=1).values
        floors.append(dense_floor(best, k))
    return torch.cat(floors)


class TopKTargets:
    """A tiled pass's target logits with each row's columns below its ``floor`` [n]
    masked (``TargetLogits``)."""

    def __init__(self, targets: TargetLogits, floor: Tensor, tie: float) -> None:
        self.targets, self.floor, self.tie = targets, floor, tie

    def __call__(self, start: int, stop: int, block: slice, out: Tensor) -> Tensor:
        return keep_top_k_(self.targets(start, stop, block, out), self.floor[block], self.tie)
