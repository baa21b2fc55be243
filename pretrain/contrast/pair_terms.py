"""SINCERE's pair terms over each anchor's positives, sum_p softplus(lse_i - l_ip + eps),
beside the log-sum-exp lse_i over its negatives, in one autograd node: dense on the [n, N]
logits, or tiled (``tiles.py``) with a backward that recomputes each tile's logits once;
:func:`pair_terms` is the operation SINCERE's loss calls.

softplus(x) is taken as -log sigmoid(-x): two vectorised passes where torch's CPU softplus
makes one several times slower. Its absolute error is float32's resolution near 1 (6e-8 a
pair); below ``FLOOR`` (a pair 80 logits under its negatives) sigmoid would leave the
normal floats, and there -log sigmoid(y) = -y to any float's precision.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import torch
from torch import Tensor

from pretrain.contrast.batch import ContrastiveBatch
from pretrain.contrast.columns import (
    MASKED_LOGIT,
    NEGLIGIBLE_LOG_WEIGHT,
    Columns,
    ColumnTiles,
    PositiveKind,
)
from pretrain.contrast.common import Temperature, as_float, scaled
from pretrain.contrast.rows import (
    Over,
    PairTerms,
    RowTerms,
    columns_over,
    lse_and_softmax,
    softmax_ess,
    spend,
    tile_plan,
    tiled_terms,
)
from pretrain.contrast.tiles import (
    TileBuffers,
    TiledRows,
    TilePlan,
    _forward,
    _PassSums,
    _tiled_rows,
    row_blocks,
)

FLOOR = -80.0  # sigmoid(y) >= e^-80 is a normal float32


def softplus_sum_(y: Tensor, scratch: Tensor) -> Tensor:
    """[n] sum_j softplus(-y_ij) = -log sigmoid(y_ij) over the rows of ``y`` [n, T]; an
    entry of -MASKED_LOGIT adds 0. Floors ``y`` at FLOOR in place; overwrites ``scratch`` [n, T]."""
    below = torch.clamp(y, max=FLOOR, out=scratch).sub_(FLOOR).sum(1)  # sum of min(y - F, 0)
    y.clamp_(min=FLOOR)
    return torch.sigmoid(y, out=scratch).log_().sum(1).add_(below).neg_()


class DensePairTerms(NamedTuple):
    lse: Tensor  # [n] over the columns, with gradient
    pair_sum: Tensor  # [n] sum over the positives of softplus(lse_i - l_ij + eps), with grad
    probs: Tensor  # [n, N] the softmax over the columns
    positive_lse: Tensor  # [n] over the positives; MASKED_LOGIT where an anchor has none
    logit_sum: Tensor | None  # [n] the columns' logit sum, when asked for


def dense_rows_and_pair_terms(logits: Tensor, columns: Columns, positives: Columns,
                              eps: float, logit_sum: bool) -> DensePairTerms:
    """SINCERE's row terms from the [n, N] ``logits``, a fresh matmul output that they
    overwrite."""
    with torch.no_grad():
        shifted = logits.detach().clone()
        columns.fill_(logits, MASKED_LOGIT)
        kept_sum = columns.apply(logits, 0.0).sum(1) if logit_sum else None
    return DensePairTerms(*_DenseRowsAndPairTerms.apply(logits, shifted, positives, eps),
                          kept_sum)


class _DenseRowsAndPairTerms(torch.autograd.Function):
    """Forward: the softmax of the masked logits, then y_ij = l_ij - lse_i - eps in the
    copy ``shifted`` (+1e30 off the positives), whose softplus(-y) are the pair terms;
    ``masked`` ends as scratch. Backward: the logits' gradient, formed in place in the
    saved softmax, g_i p_ij - g'_i sigmoid(-y_ij), where g' is the pair sums' gradient and
    g_i = g_lse,i + g'_i sum_p sigmoid(-y_ip) (the terms reach lse_i too)."""

    @staticmethod
    def forward(ctx, masked: Tensor, shifted: Tensor, positives: Columns,
                eps: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        ctx.set_materialize_grads(False)
        ctx.spent = False
        lse, probs = lse_and_softmax(masked)
        shifted.sub_((lse + eps)[:, None])
        # the positives' log-sum-exp, lse_i + eps + log sum_p e^{y_ip}; the others' terms
        # 80 below the row's top, where exp stays on its fast path and adds nothing
        top = positives.fill_(shifted, MASKED_LOGIT).amax(1, keepdim=True)  # [n, 1]
        has = top > MASKED_LOGIT
        total = torch.sub(shifted, top, out=masked).clamp_(min=NEGLIGIBLE_LOG_WEIGHT).exp_()
        positive_lse = torch.where(has, total.sum(1, keepdim=True).log_() + top
                                   + (lse + eps)[:, None], MASKED_LOGIT)[:, 0]
        positives.fill_(shifted, -MASKED_LOGIT)  # off the positives: no term, no slope
        pair_sum = softplus_sum_(shifted, scratch=masked)
        ctx.save_for_backward(probs, shifted)
        ctx.mark_non_differentiable(probs, positive_lse)
        return lse, pair_sum, probs, positive_lse

    @staticmethod
    def backward(ctx, grad_lse: Tensor | None, grad_pairs: Tensor | None, *_: None,
                 ) -> tuple[Tensor | None, None, None, None]:
        spend(ctx)
        if grad_lse is None and grad_pairs is None:
            return None, None, None, None
        probs, shifted = ctx.saved_tensors
        grad_pairs = torch.zeros_like(probs[:, 0]) if grad_pairs is None else grad_pairs
        slope = shifted.neg_().sigmoid_()  # -d terms / d l_ip; 0 off the positives
        row = grad_pairs * slope.sum(1)
        row = row if grad_lse is None else row.add_(grad_lse)
        grad = probs.mul_(row[:, None]).addcmul_(slope, grad_pairs[:, None], value=-1)
        return grad, None, None, None


class _RowsAndPairTerms(torch.autograd.Function):
    """The tiled pass of ``plan`` (its log-sum-exp lse_i over the negatives, and its
    monitors) and SINCERE's pair terms sum over the columns of ``positives`` of
    softplus(lse_i - l_ij + eps), per anchor [n], in one node. Its backward
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
            y = pairs.fill_(logits.sub_(sums.lse[block, None] + eps), -MASKED_LOGIT)
            scratch = buffers["slopes"](*y.shape)
            slope_sum[block] += torch.neg(y, out=scratch).sigmoid_().sum(1)  # 0 off pairs
            pair_sum[block] += softplus_sum_(y, scratch)
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
    over ``positives`` of softplus(lse_i - l_ij + eps), with gradient."""
    *sums, pair_sum = _RowsAndPairTerms.apply(anchors, columns, plan, positives, eps)
    return _tiled_rows(plan, _PassSums(*sums)), pair_sum


def pair_terms(batch: ContrastiveBatch, kind: PositiveKind, *, over: Over,
               temperature: Temperature, eps: float) -> PairTerms:
    """:func:`logsumexp_with_positives` and, over each anchor's positives p, the sum of
    softplus(lse_i - l_ip + eps) - eps: SINCERE's pair terms (tiled, one pass whose
    backward recomputes each tile once, with no [P] pair list)."""
    column_set = columns_over(kind, over)
    positives = column_set.positives_only
    anchors, columns = scaled(batch.anchors, temperature), as_float(batch.candidates)
    if batch.tile_size is None:
        dense = dense_rows_and_pair_terms(
            anchors @ columns.T, batch.columns(column_set), batch.columns(positives), eps,
            logit_sum=batch.num_negatives is not None)
        rows = RowTerms(dense.lse, softmax_ess(batch, column_set, dense.probs),
                        dense.logit_sum)
        positive_lse, pair_sum = dense.positive_lse, dense.pair_sum
    else:
        plan = tile_plan(batch, column_set, monitors=True, positive_lse=True)
        tiled, pair_sum = tiled_rows_and_pair_terms(anchors, columns, plan,
                                                    batch.column_tiles(positives), eps)
        rows, positive_lse = tiled_terms(batch, column_set, tiled, True), tiled.positive_lse
    num_positives = batch.num_positives_per_anchor(kind).to(pair_sum.dtype)
    return PairTerms(rows, positive_lse, pair_sum - eps * num_positives)
