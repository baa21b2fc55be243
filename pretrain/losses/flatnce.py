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

from pretrain.losses.batch import ContrastiveBatch
from pretrain.losses.common import (
    ObjectiveOutput,
    Temperature,
    finish,
    full_precision,
    masked_logsumexp,
    positive_logit_mean,
    similarity_logits,
)


def flat_nce_from_logits(pos_logit: Tensor, logits: Tensor, negatives: Tensor) -> Tensor:
    """Per-anchor FlatNCE, [n]: exp(v - detach v) - 1 with v = lse_neg(logits) - pos_logit.

    ``pos_logit`` [n], ``logits`` [n, N], ``negatives`` [n, N] bool. Anchors without a
    negative give 0 with zero gradient.
    """
    has_negative = negatives.any(dim=1)
    v = masked_logsumexp(logits, negatives) - pos_logit
    v = torch.where(has_negative, v, torch.zeros_like(v))
    return torch.exp(v - v.detach()) - 1


def flat_family(batch: ContrastiveBatch, temperature: Temperature,
                gamma: float = 1.0) -> ObjectiveOutput:
    """FlatNCE on gamma * (s / tau); gamma = 1 is plain FlatNCE."""
    kind = "instance"
    with full_precision(batch):
        logits = similarity_logits(batch.anchors, batch.candidates, temperature)  # [n, N]
        pos_mean, _ = positive_logit_mean(batch, kind, temperature)  # [n]
        per_anchor = flat_nce_from_logits(gamma * pos_mean, gamma * logits,
                                          batch.negative_mask(kind))
        loss = batch.anchor_mean(per_anchor, kind)
        return finish(batch, loss, logits, kind, temperature, report_infonce=True,
                      pos_mean=pos_mean)


def flatnce(batch: ContrastiveBatch, temperature: Temperature) -> ObjectiveOutput:
    """FlatNCE with instance positives (the FlatCLR objective)."""
    return flat_family(batch, temperature, gamma=1.0)
