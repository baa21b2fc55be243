"""The one row reduction every objective needs, dense or tiled.

``row_logsumexp(batch, anchors, columns, kind, over=...)`` is log sum_j exp(a_i . c_j) over
the columns ``over`` names, with the monitors over the negatives of ``kind``. With
``batch.tile_size`` unset it materialises the [n, N] logits (fastest while they fit); with
it set it walks column tiles (``tiles.py``) and no [n, N] tensor exists. Both give the same
values and gradients (``tests/pretrain/objectives/test_tiles.py``).
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch
from torch import Tensor

from pretrain.contrast.batch import ContrastiveBatch
from pretrain.contrast.columns import (
    MASKED_LOGIT,
    NEGLIGIBLE_LOG_WEIGHT,
    ColumnSet,
    PositiveKind,
)
from pretrain.contrast.common import Temperature, as_float, row_softmax_, scaled
from pretrain.contrast.pair_terms import dense_rows_and_pair_terms, tiled_rows_and_pair_terms
from pretrain.contrast.symmetric_tiles import symmetric_rows
from pretrain.contrast.tiles import (
    TargetLogits,
    TiledRows,
    TilePlan,
    tiled_rows,
)

Over = Literal["others", "negatives", "negatives_and_self"]
OVER: dict[str, dict[str, bool]] = {
    "others": {"positives": True},  # every candidate but the anchor itself: j != i
    "negatives": {"positives": False},  # the anchor's negatives alone
    "negatives_and_self": {"positives": False, "self_column": True},  # and column j = i
}


def columns_over(kind: PositiveKind, over: Over) -> ColumnSet:
    """The :class:`ColumnSet` a reduction ``over`` the columns of an anchor's row reads."""
    if over not in OVER:
        raise ValueError(f"row_logsumexp: over={over!r}; one of {', '.join(OVER)}")
    return ColumnSet(kind, **OVER[over])


class RowTerms(NamedTuple):
    """Per-anchor results [n]: ``lse`` with gradient; the rest when asked for."""

    lse: Tensor
    ess: Tensor | None = None  # ESS of the softmax restricted to the negatives
    negative_logit_sum: Tensor | None = None  # under num_negatives: sum of negatives' logits
    positive_lse: Tensor | None = None  # log-sum-exp over the anchor's positives, no grad
    column_lse: Tensor | None = None  # the anchor's own column down the candidates, with grad
    pair_sum: Tensor | None = None  # sum_p softplus(lse_i - l_ip + eps) - eps, with grad


def ess_from_ratio(batch: ContrastiveBatch, kind: PositiveKind, ratio: Tensor) -> Tensor:
    """[n] ESS = (sum_j w_j)^2 / (K sum_j w_j^2) over the K negatives, from the ratio."""
    return ratio / batch.num_negatives_per_anchor(kind).to(ratio.dtype).clamp(min=1)


def tile_plan(batch: ContrastiveBatch, column_set: ColumnSet, *, monitors: bool,
              targets: TargetLogits | None = None, positive_lse: bool = False,
              column_lse: bool = False, symmetric: bool = False) -> TilePlan:
    """The :class:`TilePlan` of ``column_set`` (and its negatives' monitors, the
    positives' log-sum-exp and the columns' log-sum-exp) on ``batch``; ``symmetric``
    (symmetric targets, if any) walks each pair of tiles once where the batch is
    :func:`transposable` on a CPU."""
    columns = batch.column_tiles(column_set)
    negatives = None
    if monitors:  # the columns' own tiles when they are the negatives: one mask serves both
        negatives = columns if column_set == column_set.negatives else \
            batch.column_tiles(column_set.negatives)
    return TilePlan(
        tile_size=batch.tile_size,
        columns=columns,
        targets=targets,
        negatives=negatives,
        negative_logit_sum=monitors and batch.num_negatives is not None,
        positives=batch.column_tiles(column_set.positives_only) if positive_lse else None,
        column_lse=column_lse,
        symmetric=symmetric and transposable(batch) and not batch.candidates.is_cuda)


def row_logsumexp(batch: ContrastiveBatch, anchors: Tensor, columns: Tensor,
                  kind: PositiveKind, *, over: Over, temperature: Temperature = 1.0,
                  monitors: bool = False, positive_lse: bool = False,
                  column_lse: bool = False, pair_terms: float | None = None) -> RowTerms:
    """log sum_j exp(``anchors`` [n, D] . ``columns`` [N, D] / ``temperature``), j ``over``:
    ``"others"`` every column but the anchor's own (its other positives of ``kind`` and
    its negatives), ``"negatives"`` the columns of another ``kind`` key alone, or
    ``"negatives_and_self"`` those and the anchor's own column.

    ``monitors`` adds the ESS over the negatives of ``kind`` and, under
    ``num_negatives``, their logit sum; ``positive_lse`` adds the log-sum-exp over each
    anchor's positives (without gradient; ``MASKED_LOGIT`` where an anchor has none).
    ``column_lse`` adds each anchor's own column ``columns[anchor_index]`` read down every
    candidate, log sum_k exp(x_k . c_i / tau) over the same columns (CLIP's text -> image
    direction; the anchors must be ``batch.anchors``): from the same walk of the tiles when
    every candidate is an anchor (:func:`transposable`), else from a second reduction.
    ``pair_terms`` = eps adds, with the positives' log-sum-exp, the sum over each anchor's
    positives p of softplus(lse_i - l_ip + eps) - eps (SINCERE's pair terms; tiled, one
    pass whose backward recomputes each tile once, with no [P] pair list).
    """
    column_set = columns_over(kind, over)
    if pair_terms is not None:
        if column_lse:
            raise ValueError("row_logsumexp: pair_terms and column_lse are not asked together")
        return _with_pair_terms(batch, scaled(anchors, temperature), columns, column_set,
                                pair_terms)
    if not column_lse:
        return _rows(batch, anchors, columns, column_set, temperature, monitors, positive_lse)
    if anchors is not batch.anchors:
        raise ValueError("row_logsumexp: column_lse reads the columns down batch.candidates, "
                         "so the anchors must be batch.anchors")
    if transposable(batch):
        return _rows(batch, anchors, columns, column_set, temperature, monitors, positive_lse,
                     column_lse=True)
    rows = _rows(batch, anchors, columns, column_set, temperature, monitors, positive_lse)
    own = columns[batch.anchor_index]  # [n, D] each anchor's own column
    down = _rows(batch, own, batch.candidates, column_set, temperature, False, False)
    return rows._replace(column_lse=down.lse)


def _rows(batch: ContrastiveBatch, anchors: Tensor, columns: Tensor, column_set: ColumnSet,
          temperature: Temperature, monitors: bool, positive_lse: bool,
          column_lse: bool = False) -> RowTerms:
    """:func:`row_logsumexp` over column tiles when ``batch.tile_size`` is set, else over
    the [n, N] logits (``column_lse``: tiled and :func:`transposable` only)."""
    if batch.tile_size is not None:
        plan = tile_plan(batch, column_set, monitors=monitors, positive_lse=positive_lse,
                         column_lse=column_lse)
        tiled = tiled_batch_rows(batch, anchors, columns, plan, temperature)
        return _terms(batch, column_set, tiled, monitors)
    return _dense_rows(batch, scaled(anchors, temperature), columns, column_set, monitors,
                       positive_lse)


def _dense_rows(batch: ContrastiveBatch, anchors: Tensor, columns: Tensor,
                column_set: ColumnSet, monitors: bool, positive_lse: bool) -> RowTerms:
    """The row terms of the [n, N] logits ``anchors`` (over tau) . ``columns``, masked and
    softmaxed in place; the monitors then use them as scratch."""
    logits = anchors @ as_float(columns).T  # [n, N]
    pos_lse = None
    if positive_lse:  # before the softmax masks the positives' entries
        with torch.no_grad():
            pos_lse = masked_logsumexp(logits, batch.columns(column_set.positives_only).drop)
    lse, probs = row_softmax_(logits, batch.columns(column_set))
    if not monitors:
        return RowTerms(lse, positive_lse=pos_lse)
    with torch.no_grad():
        neg_logits = None
        if batch.num_negatives is not None:
            neg_logits = batch.columns(column_set.negatives).apply(logits, 0.0).sum(1)
    return RowTerms(lse, softmax_ess(batch, column_set, probs, scratch=logits), neg_logits,
                    pos_lse)


@torch.no_grad()
def softmax_ess(batch: ContrastiveBatch, column_set: ColumnSet, probs: Tensor,
                scratch: Tensor | None = None) -> Tensor:
    """[n] the ESS of each row's softmax ``probs`` [n, N] over ``column_set``'s negatives;
    ``scratch`` [n, N], if given, is overwritten instead of allocating a copy."""
    negatives = probs
    if column_set != column_set.negatives:  # zero the columns that are not negatives
        negatives = batch.columns(column_set.negatives).apply(probs, 0.0, out=scratch)
    ratio = (negatives.sum(1) / torch.linalg.vector_norm(negatives, dim=1)).square()
    return ess_from_ratio(batch, column_set.kind, ratio)


def transposable(batch: ContrastiveBatch) -> bool:
    """Whether the logits' columns, read down the anchors, are rows of the transposed
    problem: tiled, every candidate is an anchor in its own place, and the column set keeps
    (i, j) iff it keeps (j, i): it compares keys, with no negatives subset (hashed per
    pair) and no padding rows (dropped as columns only)."""
    return (batch.tile_size is not None and batch.num_negatives is None
            and batch.valid is None and batch.anchor_rows == slice(0, batch.num_candidates))


def tiled_batch_rows(batch: ContrastiveBatch, anchors: Tensor, columns: Tensor,
                     plan: TilePlan, temperature: Temperature) -> TiledRows:
    """:func:`tiles.tiled_rows` of ``anchors`` / ``temperature`` against ``columns``;
    ``batch.anchors`` against ``batch.candidates`` (in float32 or float64) go as the
    candidates' rows they are."""
    rows = batch.anchor_rows if anchors is batch.anchors else None
    if rows is not None and columns is batch.candidates and as_float(columns) is columns:
        if plan.symmetric:
            return symmetric_rows(columns, plan, temperature)
        return tiled_rows(None, columns, plan, temperature, rows)
    return tiled_rows(as_float(anchors), as_float(columns), plan, temperature)


def _with_pair_terms(batch: ContrastiveBatch, anchors: Tensor, columns: Tensor,
                     column_set: ColumnSet, eps: float) -> RowTerms:
    """:func:`row_logsumexp` of ``anchors`` (over tau) with its monitors, the positives'
    log-sum-exp and the pair terms (``pair_terms.py``), dense or tiled."""
    positives = column_set.positives_only
    if batch.tile_size is None:
        dense = dense_rows_and_pair_terms(
            anchors @ as_float(columns).T, batch.columns(column_set),
            batch.columns(positives), eps, logit_sum=batch.num_negatives is not None)
        rows = RowTerms(dense.lse, softmax_ess(batch, column_set, dense.probs),
                        dense.logit_sum, dense.positive_lse, pair_sum=dense.pair_sum)
    else:
        plan = tile_plan(batch, column_set, monitors=True, positive_lse=True)
        tiled, pair_sum = tiled_rows_and_pair_terms(
            anchors, as_float(columns), plan, batch.column_tiles(positives), eps)
        rows = _terms(batch, column_set, tiled, monitors=True)._replace(pair_sum=pair_sum)
    num_positives = batch.num_positives_per_anchor(column_set.kind).to(rows.pair_sum.dtype)
    return rows._replace(pair_sum=rows.pair_sum - eps * num_positives)


def masked_logsumexp(values: Tensor, drop: Tensor) -> Tensor:
    """[n] log sum_j exp(``values`` [n, N]) over the entries ``drop`` [n, N] leaves,
    ``MASKED_LOGIT`` where it leaves none; no gradient.

    The left-out entries are set 80 below the row's largest kept one rather than to
    MASKED_LOGIT: an exp whose result underflows takes a slow path on x86 CPUs (16x on an
    [8192, 8192] tensor, most of it left out), and N e^-80 is far below the resolution of a
    sum that is at least 1.
    """
    top = values.masked_fill(drop, float("-inf")).amax(1, keepdim=True)  # [n, 1]
    kept = top.isfinite()
    top = torch.where(kept, top, 0.0)
    total = (values - top).masked_fill_(drop, NEGLIGIBLE_LOG_WEIGHT).exp_().sum(1, keepdim=True)
    return torch.where(kept, total.log_() + top, MASKED_LOGIT)[:, 0]


def _terms(batch: ContrastiveBatch, column_set: ColumnSet, rows: TiledRows,
           monitors: bool) -> RowTerms:
    if not monitors:
        return RowTerms(rows.lse, positive_lse=rows.positive_lse, column_lse=rows.column_lse)
    return RowTerms(rows.lse, ess_from_ratio(batch, column_set.kind, rows.ess_ratio),
                    rows.negative_logit_sum, rows.positive_lse, column_lse=rows.column_lse)
