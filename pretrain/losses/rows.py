"""The one row reduction every objective needs, dense or tiled.

``row_logsumexp(batch, anchors, columns, column_set)`` is log sum_j exp(a_i . c_j) over the
columns of ``column_set``, with the monitors over the negatives. With ``batch.tile_size``
unset it materialises the [n, N] logits (fastest while they fit); with it set it walks
column tiles (``tiles.py``) and no [n, N] tensor exists. Both give the same values and
gradients (``tests/pretrain/losses/test_tiles.py``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from pretrain.losses.batch import ContrastiveBatch
from pretrain.losses.columns import (
    MASKED_LOGIT,
    NEGLIGIBLE_LOG_WEIGHT,
    ColumnSet,
    PositiveKind,
)
from pretrain.losses.common import Temperature, as_float, row_softmax_, scaled
from pretrain.losses.pair_tiles import tiled_rows_and_pair_terms
from pretrain.losses.tiles import (
    TargetLogits,
    TiledRows,
    TilePlan,
    tiled_rows,
)


class RowTerms(NamedTuple):
    """Per-anchor results [n]: ``lse`` with gradient; the monitors when asked for."""

    lse: Tensor
    ess: Tensor | None = None  # ESS of the softmax restricted to the negatives
    negative_logit_sum: Tensor | None = None  # under num_negatives: sum of negatives' logits
    positive_lse: Tensor | None = None  # log-sum-exp over the anchor's positives, no grad
    positive_logits: Tensor | None = None  # dense only: [n, N] logits, 0 off the positives
    column_lse: Tensor | None = None  # tiled only: [N] log sum_i exp l_ij, with gradient


def ess_from_ratio(batch: ContrastiveBatch, kind: PositiveKind, ratio: Tensor) -> Tensor:
    """[n] ESS = (sum_j w_j)^2 / (K sum_j w_j^2) over the K negatives, from the ratio."""
    return ratio / batch.num_negatives_per_anchor(kind).to(ratio.dtype).clamp(min=1)


def tile_plan(batch: ContrastiveBatch, column_set: ColumnSet, *, monitors: bool,
              targets: TargetLogits | None = None, positive_lse: bool = False,
              column_lse: bool = False) -> TilePlan:
    """The :class:`TilePlan` of ``column_set`` (and its negatives' monitors, the
    positives' log-sum-exp and the columns' log-sum-exp) on ``batch``."""
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
        column_lse=column_lse)


def row_logsumexp(batch: ContrastiveBatch, anchors: Tensor, columns: Tensor,
                  column_set: ColumnSet, *, temperature: Temperature = 1.0,
                  monitors: bool = False, positive_lse: bool = False,
                  positive_logits: bool = False, column_lse: bool = False) -> RowTerms:
    """log sum over ``column_set`` of exp(``anchors`` [n, D] . ``columns`` [N, D] /
    ``temperature``).

    ``monitors`` adds the ESS over the negatives of ``column_set.kind`` and, under
    ``num_negatives``, their logit sum; ``positive_lse`` adds the log-sum-exp over each
    anchor's positives (without gradient; ``MASKED_LOGIT`` where an anchor has none);
    ``positive_logits`` (dense only) the [n, N] logits with gradient at the positives and 0
    elsewhere. Tiled, anchors that are ``batch.anchors`` among ``batch.candidates`` as
    columns are passed as those rows: no [n, D] copy over tau, one gradient buffer.
    ``column_lse`` (tiled, when :func:`transposable`) adds each column's log-sum-exp over
    the anchors from the same walk of the tiles.
    """
    if batch.tile_size is not None:
        if column_lse and not transposable(batch):
            raise ValueError("column_lse: needs every column's own row as its anchor, all "
                             "negatives and a symmetric column set")
        plan = tile_plan(batch, column_set, monitors=monitors, positive_lse=positive_lse,
                         column_lse=column_lse)
        tiled = tiled_batch_rows(batch, anchors, columns, plan, temperature)
        return _terms(batch, column_set, tiled, monitors)
    if column_lse:
        raise ValueError("column_lse: tiled passes only")
    logits = scaled(anchors, temperature) @ as_float(columns).T  # [n, N]
    pos_lse = pos_logits = None
    positives = batch.columns(column_set.positives_only) if positive_lse or positive_logits \
        else None
    if positive_logits:  # out of place: the fill below does not touch it
        pos_logits = logits.masked_fill(positives.drop, 0.0)
    if positive_lse:  # before the softmax masks the positives' entries
        with torch.no_grad():
            pos_lse = masked_logsumexp(logits, positives.drop)
    lse, probs = row_softmax_(logits, batch.columns(column_set))
    if not monitors:
        return RowTerms(lse, positive_lse=pos_lse, positive_logits=pos_logits)
    with torch.no_grad():
        neg_logits = None
        if batch.num_negatives is not None:
            neg_logits = batch.columns(column_set.negatives).apply(logits, 0.0).sum(1)
    return RowTerms(lse, softmax_ess(batch, column_set, probs), neg_logits, pos_lse,
                    pos_logits)


@torch.no_grad()
def softmax_ess(batch: ContrastiveBatch, column_set: ColumnSet, probs: Tensor) -> Tensor:
    """[n] the ESS of each row's softmax ``probs`` [n, N] over ``column_set``'s negatives."""
    negatives = _negatives_only(batch, column_set, probs)
    ratio = (negatives.sum(1) / torch.linalg.vector_norm(negatives, dim=1)).square()
    return ess_from_ratio(batch, column_set.kind, ratio)


def transposable(batch: ContrastiveBatch) -> bool:
    """Whether the logits' columns, read down the anchors, are rows of the transposed
    problem: tiled, every candidate is an anchor in its own place, and the column set keeps
    (i, j) iff it keeps (j, i): it compares keys, with no negatives subset (hashed per
    pair) and no padding rows (dropped as columns only)."""
    return (batch.tile_size is not None and batch.num_negatives is None
            and batch.valid is None and batch.anchor_rows == slice(0, batch.num_candidates))


def both_directions(batch: ContrastiveBatch, column_set: ColumnSet,
                    temperature: Temperature) -> tuple[RowTerms, Tensor]:
    """(image -> text rows over ``column_set`` with their monitors, [n] text -> image
    log-sum-exp) of the anchors over tau against ``batch.text``. When every row is an anchor (one
    rank holding the whole batch) the text -> image logits are the image -> text ones
    transposed, and a tiled pass reads both directions from one walk of the tiles;
    otherwise each direction has its own."""
    images = scaled(batch.anchors, temperature)  # [n, D]
    if transposable(batch):
        rows = row_logsumexp(batch, images, batch.text, column_set, monitors=True,
                             column_lse=True)
        return rows, rows.column_lse
    texts = scaled(batch.text[batch.anchor_index], temperature)  # [n, D]
    return (row_logsumexp(batch, images, batch.text, column_set, monitors=True),
            row_logsumexp(batch, texts, batch.candidates, column_set).lse)


def tiled_batch_rows(batch: ContrastiveBatch, anchors: Tensor, columns: Tensor,
                     plan: TilePlan, temperature: Temperature) -> TiledRows:
    """:func:`tiles.tiled_rows` of ``anchors`` / ``temperature`` against ``columns``;
    ``batch.anchors`` against ``batch.candidates`` (in float32 or float64) go as the
    candidates' rows they are."""
    rows = batch.anchor_rows if anchors is batch.anchors else None
    if rows is not None and columns is batch.candidates and as_float(columns) is columns:
        return tiled_rows(None, columns, plan, temperature, rows)
    return tiled_rows(as_float(anchors), as_float(columns), plan, temperature)


def row_logsumexp_and_pair_terms(batch: ContrastiveBatch, columns: Tensor, column_set: ColumnSet,
                                 temperature: Temperature,
                                 eps: float) -> tuple[RowTerms, Tensor]:
    """:func:`row_logsumexp` of the anchors over tau against ``columns`` over SINCERE's
    negatives ``column_set``, with its monitors and
    the positives' log-sum-exp, and [n] the sum over each anchor's positives of
    softplus(lse_i - l_ip + eps) - eps. Dense, the positives' logits are taken off the
    [n, N] logits; tiled, one pass whose backward recomputes each tile once
    (``pair_tiles.tiled_rows_and_pair_terms``), with no [P] pair list."""
    anchors = scaled(batch.anchors, temperature)  # [n, D]
    if batch.tile_size is None:
        negatives = row_logsumexp(batch, anchors, columns, column_set, monitors=True,
                                  positive_lse=True, positive_logits=True)
        terms = F.softplus(negatives.lse[:, None] - negatives.positive_logits + eps) - eps
        drop = batch.columns(column_set.positives_only).drop
        return negatives, terms.masked_fill(drop, 0.0).sum(1)  # [n]
    plan = tile_plan(batch, column_set, monitors=True, positive_lse=True)
    rows, pair_sum = tiled_rows_and_pair_terms(
        anchors, as_float(columns), plan, batch.column_tiles(column_set.positives_only), eps)
    return _terms(batch, column_set, rows, monitors=True), pair_sum


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


def _negatives_only(batch: ContrastiveBatch, column_set: ColumnSet, probs: Tensor) -> Tensor:
    """[n, N] ``probs`` with every column that is not a negative set to 0."""
    if column_set == column_set.negatives:
        return probs
    return batch.columns(column_set.negatives).apply(probs, 0.0)
