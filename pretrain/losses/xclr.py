"""X-CLR, X-Sample Contrastive Loss (Sobal et al., eq. 2-3); SPEC section 3 ``xclr``.

targets     t_ij = softmax_{j != i} (c_i . c_j / tau_s)
predictions q_ij = softmax_{j != i} (s_ij / tau)
loss_i      = -sum_j t_ij log q_ij = logsumexp_{j != i}(s_ij/tau) - sum_j t_ij s_ij/tau.
c_i . c_j comes from caption embeddings [N, E] or, for the ImageNet recipe, from the
C x C class graph looked up by the label pair. Targets are built per batch and carry no
gradient. The mean runs over all anchors (every anchor has a soft positive).
"""

from __future__ import annotations

import torch
from torch import Tensor

from pretrain.losses.batch import ContrastiveBatch
from pretrain.losses.common import (
    MASKED_LOGIT,
    ObjectiveOutput,
    Temperature,
    as_float,
    finish,
    full_precision,
    masked_logsumexp,
    similarity_logits,
)


def target_similarity(batch: ContrastiveBatch) -> Tensor:
    """[n, N] c_i . c_j between anchors and candidates, from the class graph or captions."""
    if batch.class_graph is not None:
        if batch.labels is None:
            raise ValueError("xclr: a class_graph needs labels to look up class pairs")
        graph = as_float(batch.class_graph)
        labels = batch.labels
        if int(labels.max()) >= graph.shape[0] or int(labels.min()) < 0:
            raise ValueError(f"xclr: labels must lie in [0, {graph.shape[0]}) of class_graph")
        rows = graph.index_select(0, labels[batch.anchor_index])
        return rows.index_select(1, labels)
    if batch.captions is None:
        raise ValueError("xclr: needs caption embeddings (captions=) or a class_graph")
    captions = as_float(batch.captions)
    return captions[batch.anchor_index] @ captions.T


def soft_targets(batch: ContrastiveBatch, target_temperature: float,
                 columns: Tensor) -> Tensor:
    """[n, N] rows of t_ij, zero outside ``columns`` (self and dropped negatives)."""
    with torch.no_grad():
        sim = target_similarity(batch) / target_temperature
        return torch.softmax(sim.masked_fill(~columns, MASKED_LOGIT), dim=1)


def xclr(batch: ContrastiveBatch, temperature: Temperature, *,
         target_temperature: float = 0.1) -> ObjectiveOutput:
    """Soft-target contrastive loss; ``target_temperature`` is the paper's tau_s."""
    with full_precision(batch):
        columns = batch.candidate_mask("instance")
        targets = soft_targets(batch, target_temperature, columns)  # [n, N]
        logits = similarity_logits(batch.anchors, batch.candidates, temperature)  # [n, N]
        lse = masked_logsumexp(logits, columns)
        per_anchor = lse - (targets * logits).sum(dim=1)
        loss = batch.anchor_mean(per_anchor, None)
        entropy = -(targets * torch.log(targets.clamp(min=1e-30))).sum(1)
        return finish(batch, loss, logits, None, temperature, lse_all=lse,
                      extra={"target_entropy": batch.anchor_mean(entropy, None)})
