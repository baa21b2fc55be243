"""The row reduction of pairwise sigmoid objectives (SigLIP), dense or tiled.

``sigmoid_rows(batch, columns, temperature, bias)`` is
sum_i w_i sum_j softplus(a_i . c_j / tau + b) over each anchor's negatives j: the weighted
negative-pair terms -log sigmoid(-(l_ij + b)) of every anchor, one scalar. With
``batch.tile_size`` unset it materialises the [n, N] logits; with it set it walks column
tiles as ``tiles.py`` does, in O((n + N) D + n T) memory. A sum of softplus needs no
normaliser (no log-sum-exp), so each tile's gradient, sigmoid(l_ij + b), is final when the
tile is made: the tiled forward also accumulates d/d a, d/d c and d/d b of the scalar, and
the backward only scales them. One walk and three matmuls a tile, where recomputing the
logits in the backward would take two walks and four. A masked logit is MASKED_LOGIT:
softplus and sigmoid of it are exactly 0, so it adds neither loss nor gradient.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor
from torch.nn import functional as F

from pretrain.contrast.batch import ContrastiveBatch
from pretrain.contrast.columns import MASKED_LOGIT, ColumnSet, ColumnTiles
from pretrain.contrast.common import Temperature, as_float, scaled
from pretrain.contrast.tiles import TileBuffers, row_blocks

NEGATIVES = ColumnSet("instance", positives=False)  # all but the columns of the row's image


class SigmoidRows(NamedTuple):
    """The negative-pair terms of a batch's anchors."""

    weighted_sum: Tensor  # 0-dim sum_i w_i sum_j softplus(l_ij + b), with gradient
    product_sum: Tensor | None  # [n], under num_negatives: sum over the columns of l_ij


def sigmoid_rows(batch: ContrastiveBatch, columns: Tensor, temperature: Temperature,
                 bias: Temperature) -> SigmoidRows:
    """sum_i w_i sum over the negatives j of softplus(a_i . ``columns[j]`` / tau +
    ``bias``), a_i the anchors, w_i their weights in ``batch.anchor_mean``, ``columns``
    [N, D] and j every column but those of the anchor's image (its own among them).

    ``bias`` is a float or a 0-dim tensor (learnable, with gradient). Under
    ``num_negatives`` the plain logit sum of each row over the same columns comes too (the
    negative-cosine monitor).
    """
    anchors, columns = scaled(batch.anchors, temperature), as_float(columns)  # [n, D], [N, D]
    weights = batch.anchor_weights(None, like=anchors)  # [n], no gradient
    bias = bias.to(anchors.dtype) if isinstance(bias, Tensor) else anchors.new_tensor(bias)
    with_products = batch.num_negatives is not None
    if batch.tile_size is not None:
        total, products = _TiledSoftplus.apply(
            anchors, columns, bias, weights.detach(),
            _Plan(batch.tile_size, batch.column_tiles(NEGATIVES), with_products))
        return SigmoidRows(total, products if with_products else None)
    kept = batch.columns(NEGATIVES)
    products = anchors @ columns.T  # [n, N]
    product_sum = kept.apply(products.detach(), 0.0).sum(1) if with_products else None
    logits = products + bias
    with torch.no_grad():  # the add saved nothing; left-out entries then get no gradient
        kept.fill_(logits, MASKED_LOGIT)
    return SigmoidRows((weights.detach() * F.softplus(logits).sum(1)).sum(), product_sum)


class _Plan(NamedTuple):
    tile_size: int
    columns: ColumnTiles
    with_products: bool


class _TiledSoftplus(torch.autograd.Function):
    """(0-dim sum_i w_i sum_j softplus(l_ij) with gradient, [n] logit sums without) of the
    logits l = ``anchors @ columns.T + bias`` over ``plan.columns``, one [rows, T] tile at a
    time; the gradients are made in the forward (when an input needs one) and saved."""

    @staticmethod
    def forward(ctx, anchors: Tensor, columns: Tensor, bias: Tensor, weights: Tensor,
                plan: _Plan) -> tuple[Tensor, Tensor]:
        ctx.set_materialize_grads(False)
        needs_anchors, needs_columns, needs_bias = ctx.needs_input_grad[:3]
        make_grads = needs_anchors or needs_columns or needs_bias
        n = len(anchors)
        row_sums, products = anchors.new_zeros(n), anchors.new_zeros(n)
        sigmoid_sums = anchors.new_zeros(n)  # d / d b of each row's sum
        grad_anchors = torch.zeros_like(anchors) if needs_anchors else None
        grad_columns = torch.zeros_like(columns) if needs_columns else None
        buffers = TileBuffers(anchors, plan.tile_size)
        for block in row_blocks(n, plan.tile_size, anchors.device):
            rows = anchors[block]
            weighted = rows * weights[block, None] if needs_columns else None
            for start in range(0, columns.shape[0], plan.tile_size):
                stop = min(start + plan.tile_size, columns.shape[0])
                shape = (block.stop - block.start, stop - start)
                part = columns[start:stop]
                kept = plan.columns.tile(start, stop, block, buffers["columns mask"])
                logits = torch.mm(rows, part.T, out=buffers["logits"](*shape))
                if plan.with_products:
                    copy = buffers["temporary"](*shape).copy_(logits)
                    products[block] += kept.fill_(copy, 0.0).sum(1)
                kept.fill_(logits.add_(bias), MASKED_LOGIT)
                row_sums[block] += F.softplus(logits).sum(1)
                if not make_grads:
                    continue
                grad_logits = torch.sigmoid(logits, out=buffers["temporary"](*shape))  # softplus'
                if grad_anchors is not None:  # w_i sum_j s_ij c_j, w_i applied below
                    grad_anchors[block].addmm_(grad_logits, part)
                if grad_columns is not None:  # sum_i s_ij w_i a_i
                    grad_columns[start:stop].addmm_(grad_logits.T, weighted)
                sigmoid_sums[block] += grad_logits.sum(1)
            if grad_anchors is not None:
                grad_anchors[block] *= weights[block, None]
        ctx.save_for_backward(grad_anchors, grad_columns,
                              (weights * sigmoid_sums).sum() if needs_bias else None)
        ctx.mark_non_differentiable(products)
        return (weights * row_sums).sum(), products

    @staticmethod
    def backward(ctx, grad_total: Tensor | None, _: None) -> tuple[Tensor | None, ...]:
        if grad_total is None:
            return None, None, None, None, None
        return (*(None if grad is None else grad * grad_total for grad in ctx.saved_tensors),
                None, None)
