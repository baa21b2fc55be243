"""SupCon, Khosla et al. 2020, L_out (eq. 2); docs/objectives.md.

per anchor i: -1/|P(i)| sum_{p in P(i)} log( exp(s_ip/tau) / sum_{a != i} exp(s_ia/tau) )
            = logsumexp_{a != i}(s_ia/tau) - mean_{p in P(i)} s_ip/tau
"""

from __future__ import annotations

from typing import Literal

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


def plain_supcon(rows: BatchRows, tau: float | Tensor) -> Tensor:
    """SupCon L_out as written (the definition the tests hold :func:`supcon` to):
    ``rows.z`` [N, D] every view's embedding, ``rows.labels`` [N]; the mean over anchors
    that have a positive."""
    z, labels = F.normalize(rows.z, dim=1), rows.labels
    self_pair = torch.eye(len(z), dtype=torch.bool, device=z.device)      # [N, N]
    logits = (z @ z.T / tau).masked_fill(self_pair, float("-inf"))      # s_ia / tau, a != i
    log_prob = logits.log_softmax(dim=1)                                 # [N, N]
    positive = (labels[:, None] == labels[None, :]) & ~self_pair         # p in P(i)
    count = positive.sum(1)                                              # [N] |P(i)|
    per_anchor = -log_prob.masked_fill(~positive, 0.0).sum(1) / count.clamp(min=1)
    return per_anchor[count > 0].mean()


def supcon(batch: ContrastiveBatch, temperature: float | Tensor,
           kind: Literal["instance", "label"] = "label") -> ObjectiveOutput:
    """SupCon L_out: the softmax cross-entropy averaged over each anchor's positives of
    ``kind``, the other samples of its class (label) or the other views of its image
    (instance: InfoNCE)."""
    rows = logsumexp(batch, batch.anchors, batch.candidates, kind, over="others",
                     temperature=temperature)  # [n]
    pos_mean, _ = positive_logit_mean(batch, kind, temperature)  # [n]
    per_anchor = rows.lse - pos_mean
    loss = batch.anchor_mean(per_anchor, kind)
    return finish(batch, loss, kind, temperature, infonce=per_anchor, ess=rows.ess,
                  negative_logit_sum=rows.negative_logit_sum, pos_mean=pos_mean)

