"""FlatNCE (Chen et al., "Simpler, faster, stronger: breaking the log-K curse", eq. 9).

With g+ = s_ip/tau and g_j = s_ij/tau over the negatives j in Neg(i):
    v_i = logsumexp_j (g_j - g+),   loss_i = exp(v_i - detach(v_i)) - 1.
The value is identically 0; the gradient is that of v_i, i.e. InfoNCE with the positive
removed from its own denominator (Prop. 3.1). ``metrics["loss"]`` reports the detached
InfoNCE value instead. Several positives per anchor average v over them.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pretrain.losses.batch import Columns, ContrastiveBatch
from pretrain.losses.common import (
    MASKED_LOGIT,
    ObjectiveOutput,
    Temperature,
    finish,
    full_precision,
    positive_logit_mean,
    row_softmax_,
    similarity_logits,
)


def flat_nce_from_logits(pos_logit: Tensor, logits: Tensor,
                         negatives: Columns) -> tuple[Tensor, Tensor, Tensor]:
    """Per-anchor FlatNCE [n]: exp(v - detach v) - 1 with v = lse_neg(logits) - pos_logit.

    ``pos_logit`` [n], ``logits`` [n, N], ``negatives`` the columns of each anchor's
    negatives. Anchors without a negative give 0 with zero gradient. Also returns the
    negatives' logsumexp [n] and softmax [n, N] for the metrics. ``logits`` is masked in
    place (see :func:`row_softmax_`).
    """
    lse_neg, neg_probs = row_softmax_(logits, negatives)
    has_negative = lse_neg > MASKED_LOGIT / 2
    v = torch.where(has_negative, lse_neg - pos_logit, torch.zeros_like(lse_neg))
    return torch.exp(v - v.detach()) - 1, lse_neg, neg_probs


def flatnce(batch: ContrastiveBatch, temperature: Temperature) -> ObjectiveOutput:
    """FlatNCE with instance positives (the FlatCLR objective)."""
    kind = "instance"
    with full_precision(batch):
        logits = similarity_logits(batch.anchors, batch.candidates, temperature)  # [n, N]
        pos_mean, _ = positive_logit_mean(batch, kind, temperature)  # [n]
        pos_rows, pos_cols = batch.positive_pairs(kind)
        pos_logits = logits[pos_rows, pos_cols].detach()  # for the metrics, before masking
        columns = batch.softmax_columns(kind, negatives_only=True)
        per_anchor, lse_neg, neg_probs = flat_nce_from_logits(pos_mean, logits, columns)
        loss = batch.anchor_mean(per_anchor, kind)
        return finish(batch, loss, logits, kind, temperature, report_infonce=True,
                      pos_mean=pos_mean, negatives_only=True, lse=lse_neg, probs=neg_probs,
                      pos_logits=pos_logits)
