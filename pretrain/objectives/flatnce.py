"""FlatNCE (Chen et al., "Simpler, faster, stronger: breaking the log-K curse", eq. 9).

With g+ = s_ip/tau and g_j = s_ij/tau over the negatives j in Neg(i):
    v_i = logsumexp_j (g_j - g+),   loss_i = exp(v_i - detach(v_i)) - 1.
The value is identically 0; the gradient is that of v_i, i.e. InfoNCE with the positive
removed from its own denominator (Prop. 3.1). ``metrics["loss"]`` reports the detached
InfoNCE value instead. Several positives per anchor average v over them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from pretrain.contrast.vocabulary import (
    BatchRows,
    ContrastiveBatch,
    ObjectiveOutput,
    finish,
    logsumexp_with_positives,
    positive_logit_mean,
)


def plain_flatnce(rows: BatchRows, tau: float | Tensor) -> Tensor:
    """FlatNCE as written: ``rows.z`` [N, D], ``rows.ids`` [N]. Value 0; gradient that of
    v_i = logsumexp over the negatives of s_ij / tau minus the mean positive s_ip / tau;
    the mean over anchors that have a positive (0 for one without a negative)."""
    z, ids = F.normalize(rows.z, dim=1), rows.ids
    logits = z @ z.T / tau                                               # [N, N]
    same = ids[:, None] == ids[None, :]
    positive = same & ~torch.eye(len(z), dtype=torch.bool, device=z.device)
    count = positive.sum(1)
    pos_mean = logits.masked_fill(~positive, 0.0).sum(1) / count.clamp(min=1)  # [N]
    lse_neg = logits.masked_fill(same, float("-inf")).logsumexp(1)       # [N]
    v = torch.where(lse_neg > float("-inf"), lse_neg - pos_mean, torch.zeros_like(pos_mean))
    per_anchor = torch.exp(v - v.detach()) - 1
    return per_anchor[count > 0].mean()


def flat_nce(pos_logit: Tensor, lse_neg: Tensor, has_negative: Tensor) -> Tensor:
    """Per-anchor FlatNCE [n]: exp(v - detach v) - 1 with v = lse_neg - pos_logit.

    ``pos_logit`` [n] the (mean) positive logit, ``lse_neg`` [n] the logsumexp over the
    anchor's negatives. Anchors without a negative (``has_negative`` [n] false) give 0
    with zero gradient.
    """
    v = torch.where(has_negative, lse_neg - pos_logit, torch.zeros_like(lse_neg))
    return torch.exp(v - v.detach()) - 1


def flatnce(batch: ContrastiveBatch, temperature: float | Tensor) -> ObjectiveOutput:
    """FlatNCE with instance positives (the FlatCLR objective)."""
    kind = "instance"
    negatives, positive_lse = logsumexp_with_positives(batch, kind, over="negatives",
                                                       temperature=temperature)  # [n]
    pos_mean, _ = positive_logit_mean(batch, kind, temperature)  # [n]
    has_negative = batch.num_negatives_per_anchor(kind) > 0
    loss = batch.anchor_mean(flat_nce(pos_mean, negatives.lse, has_negative), kind)
    all_lse = torch.logaddexp(negatives.lse.detach(), positive_lse)
    return finish(batch, loss, kind, temperature, report_infonce=True, pos_mean=pos_mean,
                  infonce=all_lse - pos_mean.detach(),
                  ess=negatives.ess, negative_logit_sum=negatives.negative_logit_sum)
