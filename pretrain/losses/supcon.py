"""SupCon, Khosla et al. 2020, L_out (eq. 2); docs/objectives.md.

per anchor i: -1/|P(i)| sum_{p in P(i)} log( exp(s_ip/tau) / sum_{a != i} exp(s_ia/tau) )
            = logsumexp_{a != i}(s_ia/tau) - mean_{p in P(i)} s_ip/tau
"""

from __future__ import annotations

from pretrain.losses.batch import ContrastiveBatch, PositiveKind
from pretrain.losses.common import (
    ObjectiveOutput,
    Temperature,
    finish,
    full_precision,
    positive_logit_mean,
    require_labels,
    row_softmax_,
    similarity_logits,
)


def multi_positive_nce(batch: ContrastiveBatch, temperature: Temperature,
                       kind: PositiveKind) -> ObjectiveOutput:
    """Softmax cross-entropy averaged over each anchor's positives of ``kind``."""
    with full_precision(batch):
        logits = similarity_logits(batch.anchors, batch.candidates, temperature)  # [n, N]
        lse, probs = row_softmax_(logits, batch.softmax_columns(kind))  # [n], [n, N]
        pos_mean, _ = positive_logit_mean(batch, kind, temperature)  # [n]
        loss = batch.anchor_mean(lse - pos_mean, kind)
        return finish(batch, loss, logits, kind, temperature, lse=lse, probs=probs,
                      pos_mean=pos_mean)


def supcon(batch: ContrastiveBatch, temperature: Temperature) -> ObjectiveOutput:
    """SupCon L_out with label positives."""
    require_labels(batch, "supcon")
    return multi_positive_nce(batch, temperature, "label")
