"""The row reduction of pairwise sigmoid objectives (SigLIP), dense or tiled.

``sigmoid_rows(batch, anchors, columns, column_set, bias)`` is sum_j softplus(a_i . c_j + b)
over the columns of ``column_set``: the negative-pair terms -log sigmoid(-(l_ij + b)) of
every anchor. With ``batch.tile_size`` unset it materialises the [n, N] logits; with it set
it walks column tiles as ``tiles.py`` does for the log-sum-exp, recomputing each tile's
logits in the backward, so memory is O((n + N) D + n T). A masked logit is MASKED_LOGIT:
softplus and sigmoid of it are exactly 0, so it adds neither loss nor gradient.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor
from torch.nn import functional as F

from pretrain.losses.batch import ContrastiveBatch
from pretrain.losses.columns import MASKED_LOGIT, ColumnSet, ColumnTiles
from pretrain.losses.common import Temperature, as_float
from pretrain.losses.tiles import TileBuffers, row_blocks


class SigmoidRows(NamedTuple):
    """Per-anchor results [n]."""

    softplus_sum: Tensor  # sum over the columns of softplus(l_ij + b), with gradient
    product_sum: Tensor | None  # under num_negatives: sum over the columns of l_ij, no grad


def sigmoid_rows(batch: ContrastiveBatch, anchors: Tensor, columns: Tensor,
                 column_set: ColumnSet, bias: Temperature) -> SigmoidRows:
    """sum over ``column_set`` of softplus(``anchors`` [n, D] . ``columns`` [N, D] + ``bias``).

    ``anchors`` are already divided by the temperature; ``bias`` is a float or a 0-dim
    tensor (learnable, with gradient). Under ``num_negatives`` the plain logit sum over the
    same columns comes too (the negative-cosine monitor).
    """
    columns = as_float(columns)
    bias = bias.to(anchors.dtype) if isinstance(bias, Tensor) else anchors.new_tensor(bias)
    with_products = batch.num_negatives is not None
    if batch.tile_size is not None:
        total, products = _TiledSoftplus.apply(
            anchors, columns, bias, _Plan(batch.tile_size, batch.column_tiles(column_set),
                                          with_products))
        return SigmoidRows(total, products if with_products else None)
    kept = batch.columns(column_set)
    products = anchors @ columns.T  # [n, N]
    product_sum = kept.apply(products.detach(), 0.0).sum(1) if with_products else None
    logits = products + bias
    with torch.no_grad():  # the add saved nothing; left-out entries then get no gradient
        kept.fill_(logits, MASKED_LOGIT)
    return SigmoidRows(F.softplus(logits).sum(1), product_sum)


class _Plan(NamedTuple):
    tile_size: int
    columns: ColumnTiles
    with_products: bool


def _tiles(plan: _Plan, anchors: Tensor, columns: Tensor):
    """(row block, start, stop) of every [rows, T] tile, row blocks outermost."""
    for block in row_blocks(anchors.shape[0], plan.tile_size, anchors.device):
        for start in range(0, columns.shape[0], plan.tile_size):
            yield block, start, min(start + plan.tile_size, columns.shape[0])


class _TiledSoftplus(torch.autograd.Function):
    """([n] softplus sum with gradient, [n] logit sum without) of ``anchors @ columns.T +
    bias`` over ``plan.columns``, one [rows, T] tile at a time."""

    @staticmethod
    def forward(ctx, anchors: Tensor, columns: Tensor, bias: Tensor,
                plan: _Plan) -> tuple[Tensor, Tensor]:
        ctx.set_materialize_grads(False)
        total, products = anchors.new_zeros(len(anchors)), anchors.new_zeros(len(anchors))
        buffers = TileBuffers(anchors, plan.tile_size, 2)
        for block, start, stop in _tiles(plan, anchors, columns):
            kept = plan.columns.tile(start, stop, block)
            shape = (block.stop - block.start, stop - start)
            raw = torch.mm(anchors[block], columns[start:stop].T, out=buffers[0](*shape))
            if plan.with_products:
                products[block] += kept.fill_(buffers[1](*shape).copy_(raw), 0.0).sum(1)
            total[block] += F.softplus(kept.fill_(raw.add_(bias), MASKED_LOGIT)).sum(1)
        ctx.plan = plan
        ctx.save_for_backward(anchors, columns, bias)
        ctx.mark_non_differentiable(products)
        return total, products

    @staticmethod
    def backward(ctx, grad_total: Tensor | None, _: None) -> tuple[Tensor | None, ...]:
        if grad_total is None:
            return None, None, None, None
        anchors, columns, bias = ctx.saved_tensors
        plan: _Plan = ctx.plan
        grad_anchors = torch.zeros_like(anchors)
        grad_columns = torch.zeros_like(columns) if ctx.needs_input_grad[1] else None
        grad_bias = torch.zeros_like(bias)
        buffers = TileBuffers(anchors, plan.tile_size, 1)
        for block, start, stop in _tiles(plan, anchors, columns):
            part, rows = columns[start:stop], anchors[block]
            logits = torch.addmm(bias, rows, part.T,
                                 out=buffers[0](block.stop - block.start, stop - start))
            grad_logits = plan.columns.tile(start, stop, block).fill_(logits, MASKED_LOGIT)
            grad_logits.sigmoid_().mul_(grad_total[block, None])  # softplus'
            grad_anchors[block].addmm_(grad_logits, part)
            if grad_columns is not None:
                grad_columns[start:stop].addmm_(grad_logits.T, rows)
            grad_bias += grad_logits.sum()
        return (grad_anchors, grad_columns,
                grad_bias if ctx.needs_input_grad[2] else None, None)
