"""SINCERE (Feeney & Hughes, eq. 5); SPEC section 3 ``sincere``.

per anchor i: -1/|P(i)| sum_{p in P(i)} log( e^{s_ip/tau} / (e^{s_ip/tau - eps}
                                                      + sum_{n in Neg(i)} e^{s_in/tau}) )
Other positives never appear in the denominator. ``eps = 0`` is SINCERE; ``eps > 0`` is
epsilon-SupInfoNCE (``eps_supinfonce.py``). Each pair term is computed stably as
softplus(lse_neg - s_ip/tau + eps) - eps.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pretrain.losses.batch import ContrastiveBatch
from pretrain.losses.common import (
    ObjectiveOutput,
    Temperature,
    finish,
    full_precision,
    masked_logsumexp,
    similarity_logits,
)


def sincere_family(batch: ContrastiveBatch, temperature: Temperature,
                   eps: float) -> ObjectiveOutput:
    """Per-positive-pair NCE whose denominator holds only that positive and Neg(i)."""
    kind = "label"
    with full_precision(batch):
        logits = similarity_logits(batch.anchors, batch.candidates, temperature)  # [n, N]
        lse_neg = masked_logsumexp(logits, batch.negative_mask(kind))  # [n]
        positives = batch.positive_mask(kind)
        rows, cols = positives.nonzero(as_tuple=True)  # [P] positive pairs
        pair_loss = F.softplus(lse_neg[rows] - logits[rows, cols] + eps) - eps  # [P]
        per_anchor = torch.zeros_like(lse_neg).index_add(0, rows, pair_loss)
        per_anchor = per_anchor / positives.sum(1).clamp(min=1)
        loss = batch.anchor_mean(per_anchor, kind)
        return finish(batch, loss, logits, kind, temperature)


def sincere(batch: ContrastiveBatch, temperature: Temperature) -> ObjectiveOutput:
    """SINCERE: supervised InfoNCE with same-class samples removed from each denominator."""
    return sincere_family(batch, temperature, eps=0.0)
