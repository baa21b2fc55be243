"""SupCon, Khosla et al. 2020, L_out (eq. 2); docs/objectives.md.

per anchor i: -1/|P(i)| sum_{p in P(i)} log( exp(s_ip/tau) / sum_{a != i} exp(s_ia/tau) )
            = logsumexp_{a != i}(s_ia/tau) - mean_{p in P(i)} s_ip/tau
"""

from __future__ import annotations

from pretrain.losses.batch import ContrastiveBatch, PositiveKind
from pretrain.losses.columns import ColumnSet
from pretrain.losses.common import (
    ObjectiveOutput,
    Temperature,
    finish,
    full_precision,
    positive_logit_mean,
    require_labels,
    scaled,
)
from pretrain.losses.rows import row_logsumexp


def multi_positive_nce(batch: ContrastiveBatch, temperature: Temperature,
                       kind: PositiveKind) -> ObjectiveOutput:
    """Softmax cross-entropy averaged over each anchor's positives of ``kind``."""
    with full_precision(batch):
        rows = row_logsumexp(batch, scaled(batch.anchors, temperature), batch.candidates,
                             ColumnSet(kind), monitors=True)  # [n]
        pos_mean, _ = positive_logit_mean(batch, kind, temperature)  # [n]
        per_anchor = rows.lse - pos_mean
        loss = batch.anchor_mean(per_anchor, kind)
        return finish(batch, loss, kind, temperature, infonce=per_anchor, ess=rows.ess,
                      negative_logit_sum=rows.negative_logit_sum, pos_mean=pos_mean)


def supcon(batch: ContrastiveBatch, temperature: Temperature) -> ObjectiveOutput:
    """SupCon L_out with label positives."""
    require_labels(batch, "supcon")
    return multi_positive_nce(batch, temperature, "label")
