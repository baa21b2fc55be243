"""SINCERE (Feeney & Hughes, eq. 5); docs/objectives.md.

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
    require_labels,
    row_softmax_,
    similarity_logits,
)


def sincere_family(batch: ContrastiveBatch, temperature: Temperature,
                   eps: float) -> ObjectiveOutput:
    """Per-positive-pair NCE whose denominator holds only that positive and Neg(i)."""
    kind = "label"
    require_labels(batch, "sincere" if eps == 0 else "eps_supinfonce")
    with full_precision(batch):
        logits = similarity_logits(batch.anchors, batch.candidates, temperature)  # [n, N]
        rows, cols = batch.positive_pairs(kind)  # [P] positive pairs
        pos_logits = logits[rows, cols]  # read before the softmax masks them
        columns = batch.softmax_columns(kind, negatives_only=True)
        lse_neg, neg_probs = row_softmax_(logits, columns)  # [n], [n, N]
        pair_loss = F.softplus(lse_neg[rows] - pos_logits + eps) - eps  # [P]
        per_anchor = torch.zeros_like(lse_neg).index_add(0, rows, pair_loss)
        num_pos = rows.bincount(minlength=len(lse_neg)).clamp(min=1)
        loss = batch.anchor_mean(per_anchor / num_pos, kind)
        return finish(batch, loss, logits, kind, temperature, lse=lse_neg, probs=neg_probs,
                      negatives_only=True, pos_logits=pos_logits)


def sincere(batch: ContrastiveBatch, temperature: Temperature) -> ObjectiveOutput:
    """SINCERE: supervised InfoNCE with same-class samples removed from each denominator."""
    return sincere_family(batch, temperature, eps=0.0)
