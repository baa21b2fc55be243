"""Pieces shared by the objectives: logits, masked log-sum-exp, positive terms, metrics.

All loss arithmetic runs in float32 (float64 when given float64) with autocast disabled,
and every log-softmax goes through logsumexp, so objectives stay finite at tau = 0.01
under bf16/fp16 autocast (SPEC section 3).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import NamedTuple

import torch
from torch import Tensor

from pretrain.losses.batch import ContrastiveBatch, PositiveKind

Temperature = float | Tensor

# Stands in for -inf at masked logits: exp() of it is exactly 0, yet rows with nothing left
# stay finite in forward and backward (a row of -inf makes logsumexp's backward NaN).
MASKED_LOGIT = -1e30


class ObjectiveOutput(NamedTuple):
    """``loss``: scalar to backpropagate; ``metrics``: detached scalars (SPEC section 5)."""

    loss: Tensor
    metrics: dict[str, Tensor]


@contextlib.contextmanager
def full_precision(batch: ContrastiveBatch) -> Iterator[None]:
    """Disable autocast on the batch's device so loss math runs in float32."""
    device_type = batch.candidates.device.type
    with torch.autocast(device_type=device_type, enabled=False):
        yield


def as_float(x: Tensor) -> Tensor:
    """Upcast half precision to float32; keep float32/float64 as they are."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def scalar(value: Temperature) -> float:
    """A float from a float or a (possibly grad-carrying) 0-dim tensor."""
    return float(value.detach()) if isinstance(value, Tensor) else float(value)


def similarity_logits(anchors: Tensor, candidates: Tensor, temperature: Temperature) -> Tensor:
    """[n, N] = anchors [n, D] @ candidates[N, D].T / temperature, in full precision."""
    return as_float(anchors) @ as_float(candidates).T / temperature


def masked_logsumexp(logits: Tensor, mask: Tensor) -> Tensor:
    """[n] logsumexp over the True entries of each row; a row with none gives ~MASKED_LOGIT."""
    return torch.logsumexp(logits.masked_fill(~mask, MASKED_LOGIT), dim=1)


def positive_logit_mean(batch: ContrastiveBatch, kind: PositiveKind,
                        temperature: Temperature) -> tuple[Tensor, Tensor]:
    """([n] mean over p in P(i) of s_ip / tau, [n] |P(i)|), from group sums in O(N D).

    sum_{p in P(i)} z_i . z_p = z_i . (sum of the group's z) - z_i . z_i.
    """
    _, inverse, counts = batch.group_index(kind)
    cand = as_float(batch.candidates)
    group_sums = cand.new_zeros(counts.shape[0], cand.shape[1]).index_add(0, inverse, cand)
    anchors = as_float(batch.anchors)
    anchor_group = inverse[batch.anchor_index]
    total = (anchors * group_sums[anchor_group]).sum(1) - (anchors * anchors).sum(1)
    num_pos = (counts[anchor_group] - 1).to(total.dtype)
    return total / num_pos.clamp(min=1) / temperature, num_pos


def contrastive_metrics(batch: ContrastiveBatch, logits: Tensor, kind: PositiveKind | None,
                        temperature: Temperature, *, lse_all: Tensor | None = None,
                        pos_mean: Tensor | None = None, columns: Tensor | None = None,
                        negatives: Tensor | None = None) -> dict[str, Tensor]:
    """Monitors every objective reports, on the plain similarity logits s_ij / tau [n, N].

    ``infonce``: mean_i [logsumexp over the softmax columns - mean_p s_ip/tau];
    ``mi_bound``: mean_i log(columns_i) - infonce_i; ``ess``: 1 / (K sum_j w_j^2) with
    w = softmax over the negatives (FlatNCE Sec. 3, SPEC section 3); ``pos_sim`` and
    ``neg_sim``: mean cosine similarity of positive and (kept) negative pairs.
    ``kind=None`` (xclr, clip) measures with instance positives. The keyword arguments
    reuse what the objective already computed, or redefine the pairs (``clip``).
    """
    kind = kind or "instance"
    with torch.no_grad():
        logits = logits.detach()
        columns = batch.candidate_mask(kind) if columns is None else columns
        negatives = batch.negative_mask(kind) if negatives is None else negatives
        if pos_mean is None:
            pos_mean, _ = positive_logit_mean(batch, kind, temperature)
        pos_mean = pos_mean.detach()
        lse_all = masked_logsumexp(logits, columns) if lse_all is None else lse_all.detach()
        infonce = lse_all - pos_mean
        neg_logits = logits.masked_fill(~negatives, MASKED_LOGIT)
        lse_neg = torch.logsumexp(neg_logits, dim=1)
        lse_neg2 = torch.logsumexp(2 * neg_logits, dim=1)
        num_neg = negatives.sum(1).to(logits.dtype).clamp(min=1)
        ess = torch.exp(2 * lse_neg - lse_neg2) / num_neg
        neg_sum = torch.where(negatives, logits, torch.zeros((), dtype=logits.dtype)).sum(1)
        tau = scalar(temperature)
        mi_bound = torch.log(columns.sum(1).to(logits.dtype).clamp(min=1)) - infonce
        return {
            "infonce": batch.anchor_mean(infonce, kind),
            "mi_bound": batch.anchor_mean(mi_bound, kind),
            "ess": batch.anchor_mean(ess, kind, need_negative=True),
            "pos_sim": batch.anchor_mean(pos_mean * tau, kind),
            "neg_sim": batch.anchor_mean(neg_sum * tau / num_neg, kind, need_negative=True),
        }


def finish(batch: ContrastiveBatch, loss: Tensor, logits: Tensor, kind: PositiveKind | None,
           temperature: Temperature, *, report_infonce: bool = False,
           extra: dict[str, Tensor] | None = None, **reuse: Tensor) -> ObjectiveOutput:
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
