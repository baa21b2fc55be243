"""X-CLR, X-Sample Contrastive Loss (Sobal et al., eq. 2-3); docs/objectives.md.

targets     t_ij = softmax_{j != i} (c_i . c_j / tau_s)
            (``top_k`` = k: over the k candidates j of largest c_i . c_j, ties kept)
predictions q_ij = softmax_{j != i} (s_ij / tau)
loss_i      = -sum_j t_ij log q_ij = logsumexp_{j != i}(s_ij/tau) - sum_j t_ij s_ij/tau.
c_i . c_j comes from caption embeddings [N, E] or, for the ImageNet recipe, from the
C x C class graph looked up by the label pair. Targets carry no gradient; the mean runs
over all anchors (every anchor has a soft positive). Dense, grouped or tiled, the two
terms come from ``soft_targets.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from core.config import InvalidValue
from pretrain.contrast.vocabulary import (
    BatchRows,
    ContrastiveBatch,
    ObjectiveOutput,
    finish,
    positive_logit_mean,
    soft_target_rows,
)

# top_k: candidates within TIE in cosine of the k-th are ties and kept with it (duplicate
# captions share a cosine, which two paths may round apart in the last bits)
TIE = 1e-5


def plain_xclr(rows: BatchRows, tau: float | Tensor, target_temperature: float,
               class_graph: Tensor | None = None, top_k: int = 0) -> Tensor:
    """X-CLR as written: ``rows.z`` [N, D]; c_i . c_j from the unit caption embeddings
    ``rows.captions`` [N, E], or ``class_graph`` [C, C] at each pair of ``rows.labels``; the
    targets over each anchor's ``top_k`` most similar others (0: all); the mean over every
    anchor."""
    z, tau_s = F.normalize(rows.z, dim=1), target_temperature
    if class_graph is None:
        captions = F.normalize(rows.captions, dim=1)
        similarity = captions @ captions.T                                  # [N, N]
    else:
        similarity = class_graph[rows.labels][:, rows.labels]
    self_pair = torch.eye(len(z), dtype=torch.bool, device=z.device)
    if top_k and top_k < len(z) - 1:  # the k-th largest among the others; ties within TIE
        kth = similarity.masked_fill(self_pair, float("-inf")).topk(top_k, dim=1).values
        similarity = similarity.masked_fill(similarity < kth[:, -1:] - TIE, float("-inf"))
    targets = (similarity / tau_s).masked_fill(self_pair, float("-inf")).softmax(1)  # t_ij
    log_q = (z @ z.T / tau).masked_fill(self_pair, float("-inf")).log_softmax(1)     # q_ij
    return -(targets * log_q.masked_fill(self_pair, 0.0)).sum(1).mean()


def _check_targets(batch: ContrastiveBatch) -> None:
    """The targets' inputs are there; labels outside the class graph fail on the device
    (``ContrastiveBatch.group_index``), with no value read back to the host."""
    if batch.class_graph is not None and batch.captions is not None:
        raise ValueError("xclr: give caption embeddings (captions=) or a class_graph, not "
                         "both; the targets come from one of them")
    if batch.class_graph is not None:
        if batch.labels is None:
            raise ValueError("xclr: a class_graph needs labels to look up class pairs")
        if batch.num_classes is not None and batch.num_classes != batch.class_graph.shape[0]:
            raise ValueError(f"xclr: the class_graph has {batch.class_graph.shape[0]} classes, "
                             f"the batch {batch.num_classes}")
    elif batch.captions is None:
        raise ValueError("xclr: needs caption embeddings (captions=) or a class_graph")


@dataclass
class XclrConfig:
    """``objective.xclr.*``: where the soft targets come from and how sharp they are."""

    target_temperature: float = 0.1  # tau_s of the soft targets
    class_graph: str = ""  # class_graph.npz (the ImageNet recipe); "" = caption targets
    top_k: int = 0  # each anchor's targets over its k most similar candidates (ties kept); 0 = all

    def validate(self) -> None:
        if not self.target_temperature > 0:
            raise InvalidValue("target_temperature",
                               f"must be > 0, got {self.target_temperature}")
        if self.top_k < 0:
            raise InvalidValue("top_k", f"must be >= 0 (0: every candidate), got {self.top_k}")


def xclr(batch: ContrastiveBatch, temperature: float | Tensor, *,
         target_temperature: float, top_k: int) -> ObjectiveOutput:
    """Soft-target contrastive loss; ``target_temperature`` is the paper's tau_s, ``top_k``
    the candidates each anchor's targets cover (0: all)."""
    _check_targets(batch)
    rows = soft_target_rows(batch, temperature, target_temperature, top_k, TIE)  # [n]
    loss = batch.anchor_mean(rows.lse - rows.target_term, None)
    with torch.no_grad():  # the monitors' only
        pos_mean, _ = positive_logit_mean(batch, "instance", temperature)
    return finish(batch, loss, None, temperature, infonce=rows.lse - pos_mean, ess=rows.ess,
                  negative_logit_sum=rows.negative_logit_sum, pos_mean=pos_mean,
                  extra={"target_entropy": batch.anchor_mean(rows.entropy, None)})
