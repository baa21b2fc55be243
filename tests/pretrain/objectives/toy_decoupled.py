"""Decoupled contrastive loss, DCL (Yeh et al. 2022, eq. 2): InfoNCE without the positive
in its own denominator.

per anchor i: -s_ip/tau + log sum_{j in Neg(i)} exp(s_ij/tau)
            = logsumexp_{j in Neg(i)}(s_ij/tau) - mean_{p in P(i)} s_ip/tau
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
    logsumexp,
    positive_logit_mean,
)


def plain_decoupled(rows: BatchRows, tau: float | Tensor) -> Tensor:
    """DCL as written: ``rows.z`` [N, D], ``rows.ids`` [N]; the mean over anchors that
    have a positive."""
    z, ids = F.normalize(rows.z, dim=1), rows.ids
    logits = z @ z.T / tau                                               # [N, N]
    same = ids[:, None] == ids[None, :]                                  # i, P(i)
    positive = same & ~torch.eye(len(z), dtype=torch.bool, device=z.device)
    count = positive.sum(1)
    pos_mean = logits.masked_fill(~positive, 0.0).sum(1) / count.clamp(min=1)
    lse_neg = logits.masked_fill(same, float("-inf")).logsumexp(1)       # Neg(i)
    return (lse_neg - pos_mean)[count > 0].mean()


def decoupled(batch: ContrastiveBatch, temperature: float | Tensor) -> ObjectiveOutput:
    """DCL with instance positives."""
    kind = "instance"
    negatives = logsumexp(batch, batch.anchors, batch.candidates, kind,
                          over="negatives", temperature=temperature)    # [n]
    pos_mean, _ = positive_logit_mean(batch, kind, temperature)          # [n]
    per_anchor = negatives.lse - pos_mean
    loss = batch.anchor_mean(per_anchor, kind)
    return finish(batch, loss, kind, temperature, infonce=per_anchor, ess=negatives.ess,
                  negative_logit_sum=negatives.negative_logit_sum, pos_mean=pos_mean)
