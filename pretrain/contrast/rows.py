"""The row reductions the softmax objectives are written in, dense or tiled.

``logsumexp(batch, anchors, columns, kind, over=...)`` is log sum_j exp(a_i . c_j) over
the columns ``over`` names, with the monitors over the negatives of ``kind``; every
softmax objective builds on it, and its fused row softmax is here. Two named operations
add what one objective each needs: ``logsumexp_both_ways`` (CLIP's second direction) and
``logsumexp_with_positives`` (FlatNCE); SINCERE's ``pair_terms`` sits with its machinery in
``pair_terms.py``. With ``batch.tile_size`` unset each materialises the [n, N] logits
(fastest while they fit); with it set it walks column tiles (``tiles.py``) and no [n, N]
tensor exists. Both give the same values and gradients
(``tests/pretrain/objectives/test_tiles.py``).
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
from pretrain.contrast.common import Temperature, as_float, scaled
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
        raise ValueError(f"logsumexp: over={over!r}; one of {', '.join(OVER)}")
    return ColumnSet(kind, **OVER[over])


class RowTerms(NamedTuple):
    """Per-anchor results [n]: ``lse`` with gradient; the monitors when asked for."""

    lse: Tensor
    ess: Tensor | None = None  # ESS of the softmax restricted to the negatives
    negative_logit_sum: Tensor | None = None  # under num_negatives: sum of negatives' logits


class BothWays(NamedTuple):
    """CLIP's two directions [n] each, with gradient."""

    rows: RowTerms  # along each anchor's row: image -> text
    column_lse: Tensor  # down each anchor's own column, over the candidates: text -> image


class WithPositives(NamedTuple):
    rows: RowTerms
    positive_lse: Tensor  # [n] log-sum-exp over the anchor's positives, no gradient


class PairTerms(NamedTuple):
    rows: RowTerms
    positive_lse: Tensor  # [n] as in :class:`WithPositives`
    pair_sum: Tensor  # [n] sum_p softplus(lse_i - l_ip + eps) - eps, with gradient


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


def logsumexp(batch: ContrastiveBatch, anchors: Tensor, columns: Tensor, kind: PositiveKind,
              *, over: Over, temperature: Temperature = 1.0, monitors: bool = True
              ) -> RowTerms:
    """log sum_j exp(``anchors`` [n, D] . ``columns`` [N, D] / ``temperature``), j ``over``:
    ``"others"`` every column but the anchor's own (its other positives of ``kind`` and
    its negatives), ``"negatives"`` the columns of another ``kind`` key alone, or
    ``"negatives_and_self"`` those and the anchor's own column; with its ``monitors``, the
    ESS over the negatives of ``kind`` and, under ``num_negatives``, their logit sum."""
    column_set = columns_over(kind, over)
    if batch.tile_size is not None:
        plan = tile_plan(batch, column_set, monitors=monitors)
        tiled = tiled_batch_rows(batch, anchors, columns, plan, temperature)
        return tiled_terms(batch, column_set, tiled, monitors)
    logits = scaled(anchors, temperature) @ as_float(columns).T  # [n, N]
    with torch.no_grad():  # outside autograd: a left-out entry gets probability 0
        batch.columns(column_set).fill_(logits, MASKED_LOGIT)
    lse, probs = _RowSoftmax.apply(logits)
    return _dense_monitors(batch, column_set, lse, logits, probs) if monitors else RowTerms(lse)


def logsumexp_with_positives(batch: ContrastiveBatch, kind: PositiveKind, *, over: Over,
                             temperature: Temperature) -> WithPositives:
    """:func:`logsumexp` of the batch's anchors against its candidates, with the monitors,
    and each anchor's log-sum-exp over its positives of ``kind`` (without gradient;
    ``MASKED_LOGIT`` where it has none)."""
    column_set = columns_over(kind, over)
    if batch.tile_size is not None:
        plan = tile_plan(batch, column_set, monitors=True, positive_lse=True)
        tiled = tiled_batch_rows(batch, batch.anchors, batch.candidates, plan, temperature)
        return WithPositives(tiled_terms(batch, column_set, tiled, True), tiled.positive_lse)
    logits = scaled(batch.anchors, temperature) @ as_float(batch.candidates).T  # [n, N]
    with torch.no_grad():  # the positives' entries read before the mask leaves them out
        positive_lse = masked_logsumexp(logits, batch.columns(column_set.positives_only).drop)
        batch.columns(column_set).fill_(logits, MASKED_LOGIT)
    lse, probs = _RowSoftmax.apply(logits)
    return WithPositives(_dense_monitors(batch, column_set, lse, logits, probs), positive_lse)


def logsumexp_both_ways(batch: ContrastiveBatch, columns: Tensor, kind: PositiveKind, *,
                        over: Over, temperature: Temperature) -> BothWays:
    """:func:`logsumexp` of the batch's anchors against ``columns`` (CLIP's image -> text),
    with the monitors, and each anchor's own column ``columns[anchor_index]`` read down
    every candidate, log sum_k exp(x_k . c_i / tau) over the same column set (text ->
    image): from the same walk of the tiles when every candidate is an anchor
    (:func:`transposable`), else from a second reduction."""
    if transposable(batch):
        column_set = columns_over(kind, over)
        plan = tile_plan(batch, column_set, monitors=True, column_lse=True)
        tiled = tiled_batch_rows(batch, batch.anchors, columns, plan, temperature)
        return BothWays(tiled_terms(batch, column_set, tiled, True), tiled.column_lse)
    rows = logsumexp(batch, batch.anchors, columns, kind, over=over, temperature=temperature)
    own = columns[batch.anchor_index]  # [n, D] each anchor's own column
    down = logsumexp(batch, own, batch.candidates, kind, over=over, temperature=temperature,
                     monitors=False)
    return BothWays(rows, down.lse)


class _RowSoftmax(torch.autograd.Function):
    """logsumexp of each row of masked logits, and that row softmax (no gradient).

    Forward: one fused log_softmax and one exp. Backward: softmax * grad, computed in place
    in the saved softmax, so a graph through it can be walked backward once
    (``retain_graph`` is refused).
    """

    @staticmethod
    def forward(ctx, masked: Tensor) -> tuple[Tensor, Tensor]:
        ctx.set_materialize_grads(False)  # no [n, N] zeros for the probs output's grad
        ctx.spent = False
        lse, probs = lse_and_softmax(masked)
        ctx.save_for_backward(probs)
        ctx.mark_non_differentiable(probs)
        return lse, probs

    @staticmethod
    def backward(ctx, grad_lse: Tensor | None, grad_probs: None) -> Tensor | None:
        spend(ctx)
        if grad_lse is None:
            return None
        (probs,) = ctx.saved_tensors
        # in place: also, out of place a column-broadcast multiply is ~8x slower on CPU
        return probs.mul_(grad_lse[:, None])


def lse_and_softmax(masked: Tensor) -> tuple[Tensor, Tensor]:
    """([n] logsumexp of each row, [n, N] its softmax): one fused log_softmax and one exp."""
    row_max, argmax = masked.max(dim=1)
    log_probs = torch.log_softmax(masked, dim=1)
    lse = row_max - log_probs.gather(1, argmax[:, None]).squeeze(1)
    return lse, log_probs.exp_()


def spend(ctx) -> None:
    if ctx.spent:
        raise RuntimeError("a row softmax's backward ran twice; retain_graph is not supported")
    ctx.spent = True


@torch.no_grad()
def _dense_monitors(batch: ContrastiveBatch, column_set: ColumnSet, lse: Tensor,
                    masked: Tensor, probs: Tensor) -> RowTerms:
    """``lse`` with the monitors of the row softmax ``probs`` [n, N] of the ``masked``
    logits [n, N], which they then use as scratch."""
    negative_logit_sum = None
    if batch.num_negatives is not None:
        negative_logit_sum = batch.columns(column_set.negatives).apply(masked, 0.0).sum(1)
    return RowTerms(lse, softmax_ess(batch, column_set, probs, scratch=masked),
                    negative_logit_sum)


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


def tiled_terms(batch: ContrastiveBatch, column_set: ColumnSet, rows: TiledRows,
           monitors: bool) -> RowTerms:
    if not monitors:
        return RowTerms(rows.lse)
    return RowTerms(rows.lse, ess_from_ratio(batch, column_set.kind, rows.ess_ratio),
                    rows.negative_logit_sum)
