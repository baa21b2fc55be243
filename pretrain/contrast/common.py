"""Pieces shared by the objectives: logits, positive terms, and the metrics every objective
reports (the fused masked row softmax is ``rows.py``'s).

All loss arithmetic runs in float32 (float64 when given float64) with autocast disabled,
and every log-softmax is max-shifted, so objectives stay finite at tau = 0.01 under
bf16/fp16 autocast (docs/objectives.md, "Numerics"). At large N the cost is passes over
the [n, N] logits (each as dear as the matmul on a CPU), so the code below keeps them
few: masks are sparse where they can be, and one softmax per objective serves both its
gradient and its metrics.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch
from torch import Tensor

from pretrain.contrast.batch import ContrastiveBatch, sum_by_group
from pretrain.contrast.columns import MASKED_LOGIT, PositiveKind
from pretrain.contrast.tiles import divided

Temperature = float | Tensor
LossKind = PositiveKind | Literal["text"]  # "text": an image-text loss's own-text positive


class ObjectiveOutput(NamedTuple):
    """``loss``: scalar to backpropagate; ``metrics``: detached scalars (docs/objectives.md)."""

    loss: Tensor
    metrics: dict[str, Tensor]


def as_float(x: Tensor) -> Tensor:
    """Upcast half precision to float32; keep float32/float64 as they are."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def scalar(value: Temperature) -> Temperature:
    """tau for the monitors: a float, or a 0-dim tensor detached from the graph (read on the
    host only when the metrics are reported, so a step never waits on the device), copied:
    a learnable parameter's storage changes with the update, or is freed after the
    backward under FSDP2, before the report reads it."""
    return value.detach().clone() if isinstance(value, Tensor) else float(value)


def as_metric(value: Temperature, like: Tensor) -> Tensor:
    """[] ``value`` as a tensor on ``like``'s device, beside the other metrics (a float
    would make a CPU tensor, which the metric window cannot stack with CUDA ones)."""
    if isinstance(value, Tensor):
        return value.to(like.device)
    return like.new_full((), value, dtype=torch.get_default_dtype())


def scaled(anchors: Tensor, temperature: Temperature) -> Tensor:
    """[n, D] anchors / tau: tau is folded in before any matmul with the columns."""
    return divided(as_float(anchors), temperature)


def row_dot(a: Tensor, b: Tensor) -> Tensor:
    """[n] a_i . b_i of [n, D] rows, as one batched matmul: no [n, D] product is made."""
    return torch.einsum("nd,nd->n", a, b)


def pair_logits(anchors: Tensor, columns: Tensor, pairs: tuple[Tensor, Tensor]) -> Tensor:
    """[P] logits a_r . c_c of the (rows, cols) ``pairs``, without the [n, N] matrix."""
    rows, cols = pairs
    return torch.linalg.vecdot(anchors[rows], as_float(columns)[cols])


def add_log_columns_(values: Tensor, anchor_group: Tensor, counts: Tensor) -> Tensor:
    """values [n, G] += log m_ig in place, m_ig = how many of anchor i's columns lie in
    group g: the group's size, less the anchor itself in its own group (MASKED_LOGIT when
    that leaves none, and for an empty group). Turns per-group logits into sums over the
    group's columns."""
    rows = torch.arange(len(anchor_group), device=values.device)
    log_counts = torch.where(counts > 0, torch.log(counts.clamp(min=1).to(values.dtype)),
                             torch.full((), MASKED_LOGIT, dtype=values.dtype,
                                        device=values.device))  # an empty group: no column
    own = (counts[anchor_group] - 1).to(values.dtype)
    values.add_(log_counts)
    own_group = values[rows, anchor_group] - log_counts[anchor_group]
    values[rows, anchor_group] = torch.where(own > 0, own_group + torch.log(own.clamp(min=1)),
                                             torch.full_like(own, MASKED_LOGIT))
    return values


def positive_logit_mean(batch: ContrastiveBatch, kind: LossKind,
                        temperature: Temperature) -> tuple[Tensor, Tensor]:
    """([n] mean over p in P(i) of s_ip / tau, [n] |P(i)|), from group sums in O(N D).

    sum_{p in P(i)} z_i . z_p = z_i . (sum of the group's z) - z_i . z_i. ``kind`` "text":
    each anchor's logit with its own text, one positive each.
    """
    if kind == "text":
        logit = pair_logits(scaled(batch.anchors, temperature), batch.text, batch.self_pairs())
        return logit, torch.ones_like(logit)
    _, groups, counts = batch.group_index(kind)
    total = _PositivePairSums.apply(as_float(batch.candidates), groups, batch.anchor_index,
                                    counts.shape[0])
    num_pos = batch.num_positives_per_anchor(kind).to(total.dtype)
    return total / num_pos.clamp(min=1) / temperature, num_pos


ROW_CHUNK = 65536  # rows of an [rows, D] temporary in the group sums' passes


class _PositivePairSums(torch.autograd.Function):
    """[n] sum over each anchor's group of z_i . z_p, p != i: z_i . (S_g(i) - z_i), with S
    the [G, D] group sums of the candidates z [N, D]. Neither S nor an [n, D] gather of it
    is kept for the backward, which makes S again: with g [N] the incoming gradient at the
    anchors' rows (0 elsewhere) and T_g the group sums of g_i z_i, d/dz_j = g_j S_g(j) +
    T_g(j) - 2 g_j z_j. At most one [G, D] sum and the [N, D] gradient exist at a time."""

    @staticmethod
    def forward(ctx, candidates: Tensor, groups: Tensor, anchor_index: Tensor,
                num_groups: int) -> Tensor:
        sums = sum_by_group(candidates, groups, num_groups)
        total = candidates.new_empty(anchor_index.shape[0])
        for start in range(0, anchor_index.shape[0], ROW_CHUNK):
            index = anchor_index[start:start + ROW_CHUNK]
            anchors = candidates[index]
            total[start:start + ROW_CHUNK] = row_dot(anchors, sums[groups[index]] - anchors)
        ctx.num_groups = num_groups
        ctx.save_for_backward(candidates, groups, anchor_index)
        return total

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, None, None, None]:
        candidates, groups, anchor_index = ctx.saved_tensors
        weights = candidates.new_zeros(candidates.shape[0]).index_add_(0, anchor_index, grad)
        out = sum_by_group(candidates, groups, ctx.num_groups)[groups]  # S_g(j)
        out.mul_(weights[:, None]).addcmul_(candidates, weights[:, None], value=-2.0)
        weighted = candidates.new_zeros(ctx.num_groups, candidates.shape[1])
        for start in range(0, candidates.shape[0], ROW_CHUNK):
            rows = slice(start, start + ROW_CHUNK)
            weighted.index_add_(0, groups[rows], candidates[rows] * weights[rows, None])
        for start in range(0, candidates.shape[0], ROW_CHUNK):
            rows = slice(start, start + ROW_CHUNK)
            out[rows] += weighted[groups[rows]]
        return out, None, None, None



def summarize_metrics(batch: ContrastiveBatch, kind: PositiveKind | None, *, infonce: Tensor,
                      ess: Tensor, num_positives: Tensor, pos_cos: Tensor,
                      neg_cos_sum: Tensor) -> dict[str, Tensor]:
    """Batch means of the per-anchor monitors (docs/objectives.md, "Metrics").

    ``infonce`` [n]: logsumexp over the softmax columns minus the mean positive logit;
    ``mi_bound``: log(number of columns) - infonce; ``ess`` [n] = 1 / (K sum_j w_j^2) with
    w the softmax over the K negatives (FlatNCE eq. 10); ``pos_sim``/``neg_sim``: mean
    cosine of positive and negative pairs.
    """
    num_neg = batch.num_negatives_per_anchor(kind or "instance").to(ess.dtype).clamp(min=1)
    num_columns = num_neg + num_positives.to(num_neg.dtype)
    return {
        "infonce": batch.anchor_mean(infonce, kind),
        "mi_bound": batch.anchor_mean(torch.log(num_columns) - infonce, kind),
        "ess": batch.anchor_mean(ess, kind, need_negative=True),
        "pos_sim": batch.anchor_mean(pos_cos, kind),
        "neg_sim": batch.anchor_mean(neg_cos_sum / num_neg, kind, need_negative=True),
    }


def negative_cosine_sum(batch: ContrastiveBatch, kind: PositiveKind, tau: Temperature,
                        negative_logit_sum: Tensor | None,
                        of: Literal["candidates", "text"] = "candidates") -> Tensor:
    """[n] sum of the cosines between each anchor and its negatives' embeddings (``of`` the
    candidates, or CLIP's texts): tau times the negatives' logit sum under
    ``num_negatives``, else in O(N D) from group sums."""
    if batch.num_negatives is not None:
        return negative_logit_sum * tau
    _, groups, _ = batch.group_index(kind)
    anchors = as_float(batch.anchors)
    columns = as_float(batch.candidates if of == "candidates" else batch.text)
    same_group = row_dot(anchors, batch.group_sums(kind, of)[groups[batch.anchor_index]])
    return anchors @ columns.sum(0) - same_group


def finish(batch: ContrastiveBatch, loss: Tensor, kind: LossKind | None,
           temperature: Temperature, *, infonce: Tensor | None = None,
           ess: Tensor | None = None, negative_logit_sum: Tensor | None = None,
           pos_mean: Tensor | None = None, report_infonce: bool = False,
           extra: dict[str, Temperature] | None = None) -> ObjectiveOutput:
    """Bundle a loss with the metrics every objective reports and ``extra`` ones (a
    0-dim tensor or a float each), all detached.

    ``pos_mean`` [n] is each anchor's mean positive logit (computed when not given),
    ``infonce`` [n] its InfoNCE value and ``ess`` [n] its ESS (a softmax's monitors),
    ``negative_logit_sum`` [n] (under ``num_negatives``) the sum of its negatives' logits;
    positives of ``kind`` (``None``: xclr, instance positives; ``"text"``: an image-text
    loss, whose positive is the anchor's own text, ``pos_mean`` its logit, the negatives
    the other texts). ``metrics["loss"]`` is the value to log: the loss itself, or with
    ``report_infonce`` the InfoNCE value (FlatNCE, whose loss value is identically 0).
    """
    with torch.no_grad():
        tau = scalar(temperature)
        if kind == "text":
            metrics = _text_metrics(batch, loss, tau, pos_mean, infonce, ess,
                                    negative_logit_sum)
        else:
            kind = kind or "instance"
            if pos_mean is None:
                pos_mean, _ = positive_logit_mean(batch, kind, temperature)
            metrics = summarize_metrics(
                batch, kind, infonce=infonce.detach(), ess=ess,
                num_positives=batch.num_positives_per_anchor(kind),
                pos_cos=pos_mean.detach() * tau,
                neg_cos_sum=negative_cosine_sum(batch, kind, tau, negative_logit_sum))
        metrics.update({name: as_metric(scalar(value), loss)
                        for name, value in (extra or {}).items()})
    metrics["loss"] = metrics["infonce"] if report_infonce else loss.detach()
    metrics["temperature"] = as_metric(tau, loss)
    return ObjectiveOutput(loss, metrics)


def _text_metrics(batch: ContrastiveBatch, loss: Tensor, tau: Temperature, pos_logit: Tensor,
                  infonce: Tensor | None, ess: Tensor | None,
                  negative_logit_sum: Tensor | None) -> dict[str, Tensor]:
    """An image-text loss's metrics: ``pos_sim`` from ``pos_logit`` [n] (each row's own text
    over tau), ``neg_sim`` over its negative texts; with ``infonce`` and ``ess`` [n] (image
    -> text) the softmax's monitors."""
    neg_cos = negative_cosine_sum(batch, "instance", tau, negative_logit_sum, of="text")
    pos_cos = pos_logit.detach() * tau
    if infonce is not None:
        return summarize_metrics(batch, None, infonce=infonce.detach(), ess=ess,
                                 num_positives=torch.ones_like(pos_logit), pos_cos=pos_cos,
                                 neg_cos_sum=neg_cos)
    num_neg = batch.num_negatives_per_anchor("instance").to(loss.dtype).clamp(min=1)
    return {"pos_sim": batch.anchor_mean(pos_cos, None),
            "neg_sim": batch.anchor_mean(neg_cos / num_neg, None)}
