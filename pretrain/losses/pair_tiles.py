"""SINCERE's tiled pass: the log-sum-exp over the negatives (``tiles.py``) and the pair
terms over each anchor's positives, sum_p softplus(lse_i - l_ip + eps) - eps, in one
autograd node whose backward recomputes each tile's logits once for both."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

from pretrain.losses.columns import MASKED_LOGIT, Columns, ColumnTiles
from pretrain.losses.tiles import (
    TileBuffers,
    TiledRows,
    TilePlan,
    _forward,
    _PassSums,
    _tiled_rows,
    row_blocks,
)


class _RowsAndPairTerms(torch.autograd.Function):
    """The tiled pass of ``plan`` (its log-sum-exp lse_i over the negatives, and its
    monitors) and SINCERE's pair terms sum over the columns of ``positives`` of
    softplus(lse_i - l_ij + eps) - eps, per anchor [n], in one node. Its backward
    recomputes each tile's logits once for both: d terms / d lse_i = sum_p sigmoid(lse_i -
    l_ip + eps), summed in the forward, joins the gradient of lse_i."""

    @staticmethod
    def forward(ctx, anchors: Tensor, columns: Tensor, plan: TilePlan,
                positives: ColumnTiles, eps: float) -> tuple[Tensor, ...]:
        ctx.set_materialize_grads(False)
        sums = _forward(anchors, columns, plan)
        pair_sum = anchors.new_zeros(anchors.shape[0])
        slope_sum = anchors.new_zeros(anchors.shape[0])
        buffers = TileBuffers(anchors, plan.tile_size)
        for block, _, _, pairs, logits in _pair_tiles(anchors, columns, positives,
                                                       plan.tile_size, buffers):
            x = torch.sub(sums.lse[block, None], logits, out=logits).add_(eps)
            slope = torch.sigmoid(x, out=buffers["slopes"](*x.shape))
            slope_sum[block] += pairs.fill_(slope, 0.0).sum(1)
            softplus = torch.ops.aten.softplus.out(x, 1, 20, out=x)  # F.softplus, in place
            pair_sum[block] += pairs.fill_(softplus.sub_(eps), 0.0).sum(1)
        ctx.plan, ctx.positives, ctx.eps = plan, positives, eps
        ctx.save_for_backward(anchors, columns, sums.lse, slope_sum)
        ctx.mark_non_differentiable(*sums[1:])
        return (*sums, pair_sum)

    @staticmethod
    def backward(ctx, grad_lse: Tensor | None, *grads: Tensor | None,
                 ) -> tuple[Tensor | None, Tensor | None, None, None, None]:
        grad_pairs = grads[-1]
        if grad_lse is None and grad_pairs is None:
            return None, None, None, None, None
        anchors, columns, lse, slope_sum = ctx.saved_tensors
        zero = torch.zeros_like(lse)
        grad_pairs = zero if grad_pairs is None else grad_pairs
        row_weight = (zero if grad_lse is None else grad_lse) + grad_pairs * slope_sum
        grad_anchors, grad_columns = torch.zeros_like(anchors), torch.zeros_like(columns)
        buffers = TileBuffers(anchors, ctx.plan.tile_size)
        for block, start, stop, pairs, logits in _pair_tiles(anchors, columns, ctx.positives,
                                                             ctx.plan.tile_size, buffers):
            # -d terms / d l_ip = sigmoid(lse_i - l_ip + eps), read before the mask
            slope = torch.sub(lse[block, None], logits, out=buffers["slopes"](*logits.shape))
            pairs.fill_(slope.add_(ctx.eps).sigmoid_(), 0.0).mul_(grad_pairs[block, None])
            grad_logits = ctx.plan.columns.tile(start, stop, block, buffers["columns mask"]
                                                ).fill_(logits, MASKED_LOGIT)
            grad_logits.sub_(lse[block, None]).exp_().mul_(row_weight[block, None]).sub_(slope)
            grad_anchors[block].addmm_(grad_logits, columns[start:stop])
            grad_columns[start:stop].addmm_(grad_logits.T, anchors[block])
        return grad_anchors, grad_columns, None, None, None


def _pair_tiles(anchors: Tensor, columns: Tensor, positives: ColumnTiles, tile_size: int,
                buffers: TileBuffers) -> Iterator[tuple[slice, int, int, Columns, Tensor]]:
    """(block of anchor rows, start, stop, the tile's positives as :class:`Columns`, its
    [rows, T] logits in ``buffers["logits"]``) of every tile."""
    for block in row_blocks(anchors.shape[0], tile_size, anchors.device):
        for start in range(0, columns.shape[0], tile_size):
            stop = min(start + tile_size, columns.shape[0])
            pairs = positives.tile(start, stop, block, buffers["positives mask"])
            logits = buffers["logits"](block.stop - block.start, stop - start)
            yield block, start, stop, pairs, torch.mm(anchors[block], columns[start:stop].T,
                                                      out=logits)


def tiled_rows_and_pair_terms(anchors: Tensor, columns: Tensor, plan: TilePlan,
                              positives: ColumnTiles, eps: float) -> tuple[TiledRows, Tensor]:
    """:func:`tiled_rows` of ``plan`` (its columns SINCERE's negatives) and [n] the sum
    over ``positives`` of SINCERE's pair terms with margin ``eps``, with gradient."""
    *sums, pair_sum = _RowsAndPairTerms.apply(anchors, columns, plan, positives, eps)
    return _tiled_rows(plan, _PassSums(*sums)), pair_sum
