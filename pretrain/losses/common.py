"""Pieces shared by the objectives: logits, the fused masked row softmax, positive terms,
and the metrics every objective reports.

All loss arithmetic runs in float32 (float64 when given float64) with autocast disabled,
and every log-softmax is max-shifted, so objectives stay finite at tau = 0.01 under
bf16/fp16 autocast (docs/objectives.md, "Numerics"). At large N the cost is passes over
the [n, N] logits (each as dear as the matmul on a CPU), so the code below keeps them
few: masks are sparse where they can be, and one softmax per objective serves both its
gradient and its metrics.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Literal, NamedTuple

import torch
from torch import Tensor

from pretrain.losses.batch import Columns, ContrastiveBatch, PositiveKind

Temperature = float | Tensor

# Stands in for -inf at masked logits: exp() of it is exactly 0, yet rows with nothing left
# stay finite in forward and backward (a row of -inf makes logsumexp's backward NaN).
MASKED_LOGIT = -1e30


class ObjectiveOutput(NamedTuple):
    """``loss``: scalar to backpropagate; ``metrics``: detached scalars (docs/objectives.md)."""

    loss: Tensor
    metrics: dict[str, Tensor]


@contextlib.contextmanager
def full_precision(batch: ContrastiveBatch) -> Iterator[None]:
    """Disable autocast on the batch's device so loss math runs in float32."""
    with torch.autocast(device_type=batch.candidates.device.type, enabled=False):
        yield


def require_labels(batch: ContrastiveBatch, objective: str) -> None:
    """Supervised objectives take their positives from labels and have no fallback."""
    if batch.labels is None:
        raise ValueError(f"{objective}: needs class labels (labels=, an [N] tensor); "
                         "use infonce for instance positives")


def as_float(x: Tensor) -> Tensor:
    """Upcast half precision to float32; keep float32/float64 as they are."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def scalar(value: Temperature) -> float:
    """A float from a float or a (possibly grad-carrying) 0-dim tensor."""
    return float(value.detach()) if isinstance(value, Tensor) else float(value)


def similarity_logits(anchors: Tensor, candidates: Tensor, temperature: Temperature) -> Tensor:
    """[n, N] = (anchors [n, D] / tau) @ candidates [N, D].T; tau folded in before the matmul."""
    return (as_float(anchors) / temperature) @ as_float(candidates).T


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
        row_max, argmax = masked.max(dim=1)
        log_probs = torch.log_softmax(masked, dim=1)
        lse = row_max - log_probs.gather(1, argmax[:, None]).squeeze(1)
        probs = log_probs.exp_()
        ctx.save_for_backward(probs)
        ctx.mark_non_differentiable(probs)
        return lse, probs

    @staticmethod
    def backward(ctx, grad_lse: Tensor | None, grad_probs: None) -> Tensor | None:
        if ctx.spent:
            raise RuntimeError("row_softmax: backward ran twice; retain_graph is not supported")
        ctx.spent = True
        if grad_lse is None:
            return None
        (probs,) = ctx.saved_tensors
        # in place: also, out of place a column-broadcast multiply is ~8x slower on CPU
        return probs.mul_(grad_lse[:, None])


def row_softmax_(logits: Tensor, columns: Columns) -> tuple[Tensor, Tensor]:
    """([n] logsumexp over each row's columns, with gradient; [n, N] its softmax, detached).

    Writes MASKED_LOGIT into the left-out entries of ``logits`` *in place*, outside autograd:
    valid because those entries get probability 0 and hence exactly zero gradient, and it
    saves an [n, N] copy. ``logits`` must be a fresh tensor no autograd node saved (a
    matmul output); read anything needed at the left-out entries (self, positives) before.
    """
    with torch.no_grad():
        columns.fill_(logits, MASKED_LOGIT)
    return _RowSoftmax.apply(logits)


def segment_logsumexp(values: Tensor, rows: Tensor, num_rows: int) -> Tensor:
    """[num_rows] logsumexp of ``values`` [P] grouped by ``rows`` [P]; MASKED_LOGIT if empty."""
    top = values.new_full((num_rows,), MASKED_LOGIT).scatter_reduce(
        0, rows, values, reduce="amax", include_self=True)
    sums = values.new_zeros(num_rows).index_add(0, rows, torch.exp(values - top[rows]))
    return top + torch.log(sums.clamp(min=torch.finfo(values.dtype).tiny))


def add_log_columns_(values: Tensor, anchor_group: Tensor, counts: Tensor) -> Tensor:
    """values [n, G] += log m_ig in place, m_ig = how many of anchor i's columns lie in
    group g: the group's size, less the anchor itself in its own group (MASKED_LOGIT when
    that leaves none). Turns per-group logits into sums over the group's columns."""
    rows = torch.arange(len(anchor_group), device=values.device)
    log_counts = torch.log(counts.to(values.dtype))
    own = (counts[anchor_group] - 1).to(values.dtype)
    values.add_(log_counts)
    own_group = values[rows, anchor_group] - log_counts[anchor_group]
    values[rows, anchor_group] = torch.where(own > 0, own_group + torch.log(own.clamp(min=1)),
                                             torch.full_like(own, MASKED_LOGIT))
    return values


def positive_logit_mean(batch: ContrastiveBatch, kind: PositiveKind,
                        temperature: Temperature) -> tuple[Tensor, Tensor]:
    """([n] mean over p in P(i) of s_ip / tau, [n] |P(i)|), from group sums in O(N D).

    sum_{p in P(i)} z_i . z_p = z_i . (sum of the group's z) - z_i . z_i.
    """
    _, groups, counts = batch.group_index(kind)
    anchors = as_float(batch.anchors)
    anchor_group = groups[batch.anchor_index]
    sums = batch.group_sums(kind)
    total = (anchors * sums[anchor_group]).sum(1) - (anchors * anchors).sum(1)
    num_pos = (counts[anchor_group] - 1).to(total.dtype)
    return total / num_pos.clamp(min=1) / temperature, num_pos


def contrastive_metrics(batch: ContrastiveBatch, logits: Tensor, kind: PositiveKind | None,
                        temperature: Temperature, *, lse: Tensor | None = None,
                        probs: Tensor | None = None, negatives_only: bool = False,
                        pos_mean: Tensor | None = None,
                        pos_logits: Tensor | None = None) -> dict[str, Tensor]:
    """Monitors every objective reports, on the plain similarity logits s_ij / tau [n, N].

    ``kind=None`` (xclr) measures with instance positives. ``lse`` and ``probs`` reuse the
    objective's own row softmax: over all columns, or over the negatives alone with
    ``negatives_only``. See :func:`summarize_metrics` for the definitions.
    """
    kind = kind or "instance"
    with torch.no_grad():
        logits = logits.detach()
        pos_rows, pos_cols = batch.positive_pairs(kind)
        if pos_mean is None:
            pos_mean, _ = positive_logit_mean(batch, kind, temperature)
        if pos_logits is None:
            pos_logits = logits[pos_rows, pos_cols]
        if probs is None:
            lse, probs = row_softmax_(logits.clone(), batch.softmax_columns(kind, negatives_only))
        lse = lse.detach()
        if negatives_only:  # add the positives back for the InfoNCE value
            pos_lse = segment_logsumexp(pos_logits.detach(), pos_rows, len(lse))
            lse = torch.logaddexp(lse, pos_lse)
        tau = scalar(temperature)
        return summarize_metrics(
            batch, kind, infonce=lse - pos_mean.detach(), probs=probs,
            positives=None if negatives_only else (pos_rows, pos_cols),
            num_positives=pos_rows.bincount(minlength=len(lse)),
            pos_cos=pos_mean.detach() * tau,
            neg_cos_sum=negative_cosine_sum(batch, logits, kind, tau))


def summarize_metrics(batch: ContrastiveBatch, kind: PositiveKind | None, *, infonce: Tensor,
                      probs: Tensor, positives: tuple[Tensor, Tensor] | None,
                      num_positives: Tensor, pos_cos: Tensor,
                      neg_cos_sum: Tensor) -> dict[str, Tensor]:
    """Batch means of the per-anchor monitors (docs/objectives.md, "Metrics").

    ``infonce`` [n]: logsumexp over the softmax columns minus the mean positive logit;
    ``mi_bound``: log(number of columns) - infonce; ``ess`` = 1 / (K sum_j w_j^2) with w the
    softmax over the K negatives (FlatNCE eq. 10), from ``probs`` [n, N] with the
    ``positives`` entries zeroed (``None``: probs already covers the negatives alone);
    ``pos_sim``/``neg_sim``: mean cosine of positive and negative pairs.
    """
    num_neg = batch.num_negatives_per_anchor(kind or "instance").to(probs.dtype).clamp(min=1)
    if positives is not None:
        probs = probs.index_put(positives, probs.new_zeros(()))
    ess = (probs.sum(1) / torch.linalg.vector_norm(probs, dim=1)).square() / num_neg
    num_columns = num_neg + num_positives.to(num_neg.dtype)
    return {
        "infonce": batch.anchor_mean(infonce, kind),
        "mi_bound": batch.anchor_mean(torch.log(num_columns) - infonce, kind),
        "ess": batch.anchor_mean(ess, kind, need_negative=True),
        "pos_sim": batch.anchor_mean(pos_cos, kind),
        "neg_sim": batch.anchor_mean(neg_cos_sum / num_neg, kind, need_negative=True),
    }


def negative_cosine_sum(batch: ContrastiveBatch, logits: Tensor, kind: PositiveKind,
                        tau: float, of: Literal["candidates", "text"] = "candidates",
                        ) -> Tensor:
    """[n] sum of the cosines between each anchor and its negatives' embeddings (``of``
    the candidates, or CLIP's texts), from the logits ``s / tau`` [n, N] under
    ``num_negatives``, else in O(N D) from group sums."""
    if batch.num_negatives is not None:
        return torch.where(batch.negative_mask(kind), logits, logits.new_zeros(())).sum(1) * tau
    _, groups, _ = batch.group_index(kind)
    anchors = as_float(batch.anchors)
    columns = as_float(batch.candidates if of == "candidates" else batch.text)
    same_group = (anchors * batch.group_sums(kind, of)[groups[batch.anchor_index]]).sum(1)
    return anchors @ columns.sum(0) - same_group


def finish(batch: ContrastiveBatch, loss: Tensor, logits: Tensor, kind: PositiveKind | None,
           temperature: Temperature, *, report_infonce: bool = False,
           extra: dict[str, Tensor] | None = None, **reuse: Tensor | bool) -> ObjectiveOutput:
    """Bundle a loss with the common metrics and objective-specific ``extra`` ones.

    ``metrics["loss"]`` is the value to log: the loss itself, or with ``report_infonce``
    the InfoNCE value (FlatNCE, whose loss value is identically 0). ``reuse`` is passed to
    :func:`contrastive_metrics`.
    """
    metrics = contrastive_metrics(batch, logits, kind, temperature, **reuse)
    metrics["loss"] = metrics["infonce"] if report_infonce else loss.detach()
    metrics["temperature"] = torch.as_tensor(scalar(temperature))
    metrics.update({name: value.detach() for name, value in (extra or {}).items()})
    return ObjectiveOutput(loss, metrics)
