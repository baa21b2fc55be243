"""ProjNCE (Jeong & Hero, Def. 2.3, eq. 9-10); SPEC section 3 ``projnce``.

psi(z, v) = z . v / tau. With projections g+ and g- of labels:
    I_proj,i = -psi(z_i, g+(y_i)) + log sum_{j != i} exp psi(z_i, g-(y_j))
    R_i      = sum_{k != i} exp psi(z_i, g+(y_k)) / sum_{k != i} exp psi(z_i, g-(y_k))
    loss     = mean_i (I_proj,i + R_i)
Variants: ``centroid`` (g+(y_k) = mean of the other samples of y_k, g-(y_k) = z_k: SupCon's
alignment plus R; a sample alone in its class uses g+ = z_k), ``kernel`` (ProjNCE-perp,
Nadaraya-Watson class means), ``median`` and ``learned`` (g+ = g-, so R = 1 exactly).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from pretrain.losses.batch import ContrastiveBatch
from pretrain.losses.common import (
    ObjectiveOutput,
    Temperature,
    as_float,
    finish,
    full_precision,
    masked_logsumexp,
    similarity_logits,
)
from pretrain.losses.projections import (
    KernelMetric,
    kernel_class_means,
    learned_class_embeddings,
    median_class_embeddings,
)

Projection = Literal["centroid", "kernel", "median", "learned"]


def _centroid_plus_logits(batch: ContrastiveBatch, logits: Tensor,
                          temperature: Temperature) -> Tensor:
    """[n, N] psi(z_i, g+(y_k)) with g+(y_k) = (S_{y_k} - z_k) / (n_{y_k} - 1)."""
    _, groups, counts = batch.group_index("label")
    cand = as_float(batch.candidates)
    sums = cand.new_zeros(counts.shape[0], cand.shape[1]).index_add(0, groups, cand)
    to_sums = (as_float(batch.anchors) @ sums.T / temperature)[:, groups]  # [n, N]
    size = counts[groups].to(logits.dtype)  # [N]
    return torch.where(size >= 2, (to_sums - logits) / (size - 1).clamp(min=1), logits)


def _group_projection(batch: ContrastiveBatch, projection: Projection, bandwidth: float,
                      kernel_metric: KernelMetric, class_embeddings: Tensor | None) -> Tensor:
    """[G, D] one projected vector per label group of the global batch."""
    values, groups, counts = batch.group_index("label")
    cand = as_float(batch.candidates)
    if projection == "kernel":
        return kernel_class_means(cand, groups, counts.shape[0], bandwidth, kernel_metric)
    if projection == "median":
        return median_class_embeddings(cand, groups, counts)
    if class_embeddings is None:
        raise ValueError("projnce learned: pass class_embeddings, a trainable [C, D] tensor")
    return learned_class_embeddings(class_embeddings.to(cand.dtype), values)


def projnce(batch: ContrastiveBatch, temperature: Temperature, *,
            projection: Projection = "centroid", bandwidth: float = 0.5,
            kernel_metric: KernelMetric = "l1",
            class_embeddings: Tensor | None = None) -> ObjectiveOutput:
    """ProjNCE with the chosen projection; ``metrics["adjustment"]`` is the mean R."""
    if batch.labels is None:
        raise ValueError("projnce: needs class labels")
    kind = "label"
    with full_precision(batch):
        logits = similarity_logits(batch.anchors, batch.candidates, temperature)  # [n, N]
        if projection == "centroid":
            plus, minus = _centroid_plus_logits(batch, logits, temperature), logits
        else:
            projected = _group_projection(batch, projection, bandwidth, kernel_metric,
                                          class_embeddings)
            _, groups, _ = batch.group_index(kind)
            plus = minus = (as_float(batch.anchors) @ projected.T / temperature)[:, groups]
        columns = batch.candidate_mask(kind)
        rows = torch.arange(plus.shape[0], device=plus.device)
        lse_minus = masked_logsumexp(minus, columns)
        i_proj = lse_minus - plus[rows, batch.anchor_index]  # [n]
        adjustment = torch.exp(masked_logsumexp(plus, columns) - lse_minus)  # [n]
        loss = batch.anchor_mean(i_proj + adjustment, kind)
        extra = {"adjustment": batch.anchor_mean(adjustment, kind),
                 "i_proj": batch.anchor_mean(i_proj, kind)}
        return finish(batch, loss, logits, kind, temperature, extra=extra)
