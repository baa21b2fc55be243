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
from torch import Tensor

from pretrain.contrast.vocabulary import (
    BatchRows,
    ContrastiveBatch,
    ObjectiveOutput,
    finish,
    pair_terms,
    positive_logit_mean,
)


def plain_sincere(rows: BatchRows, tau: float | Tensor, eps: float = 0.0) -> Tensor:
    """SINCERE as written (eps > 0: epsilon-SupInfoNCE): ``rows.z`` [N, D], ``rows.labels``
    [N]; the mean over anchors that have a positive."""
    z, labels = F.normalize(rows.z, dim=1), rows.labels
    logits = z @ z.T / tau                                               # [N, N] s_ij / tau
    same = labels[:, None] == labels[None, :]
    positive = same & ~torch.eye(len(z), dtype=torch.bool, device=z.device)
    lse_neg = logits.masked_fill(same, float("-inf")).logsumexp(1, keepdim=True)  # Neg(i)
    # -log( e^{s_ip} / (e^{s_ip - eps} + sum_{n in Neg(i)} e^{s_in}) ) for every pair
    terms = torch.logaddexp(logits - eps, lse_neg) - logits              # [N, N]
    count = positive.sum(1)
    per_anchor = terms.masked_fill(~positive, 0.0).sum(1) / count.clamp(min=1)
    return per_anchor[count > 0].mean()


def sincere_family(batch: ContrastiveBatch, temperature: float | Tensor,
                   eps: float) -> ObjectiveOutput:
    """Per-positive-pair NCE whose denominator holds only that positive and Neg(i)."""
    kind = "label"
    # lse_i over Neg(i), and sum_{p in P(i)} softplus(lse_i - l_ip + eps) - eps: the pair
    # terms -log(e^{l_ip} / (e^{l_ip - eps} + e^{lse_i}))
    negatives, positive_lse, pair_sum = pair_terms(batch, kind, over="negatives",
                                                   temperature=temperature, eps=eps)  # [n]
    pos_mean, num_pos = positive_logit_mean(batch, kind, temperature)
    loss = batch.anchor_mean(pair_sum / num_pos.clamp(min=1), kind)
    all_lse = torch.logaddexp(negatives.lse.detach(), positive_lse)
    return finish(batch, loss, kind, temperature, pos_mean=pos_mean,
                  infonce=all_lse - pos_mean.detach(), ess=negatives.ess,
                  negative_logit_sum=negatives.negative_logit_sum)


def sincere(batch: ContrastiveBatch, temperature: float | Tensor) -> ObjectiveOutput:
    """SINCERE: supervised InfoNCE with same-class samples removed from each denominator."""
    return sincere_family(batch, temperature, eps=0.0)
