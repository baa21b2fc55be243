"""ProjNCE (Jeong & Hero, Def. 2.3, eq. 9-10); docs/objectives.md.

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
    add_log_columns_,
    as_float,
    finish,
    full_precision,
    require_labels,
    row_softmax_,
    similarity_logits,
)
from pretrain.losses.projections import (
    KernelMetric,
    kernel_class_means,
    learned_class_embeddings,
    median_class_embeddings,
)

Projection = Literal["centroid", "kernel", "median", "learned"]


def _centroid_plus(batch: ContrastiveBatch) -> Tensor:
    """[N, D] g+(y_k) = (S_{y_k} - z_k) / (n_{y_k} - 1) per candidate k; z_k if alone."""
    _, groups, counts = batch.group_index("label")
    cand = as_float(batch.candidates)
    alone = (counts[groups] == 1)[:, None]
    others = batch.group_sums("label")[groups] - cand
    others = others / (counts[groups] - 1).clamp(min=1)[:, None]
    return torch.where(alone, cand, others)


def _group_lse(batch: ContrastiveBatch, group_logits: Tensor) -> Tensor:
    """[n] log sum_{j != i} exp psi(z_i, g(y_j)) from [n, G] logits and group sizes."""
    _, groups, counts = batch.group_index("label")
    summed = add_log_columns_(group_logits.clone(), groups[batch.anchor_index], counts)
    return torch.logsumexp(summed, dim=1)


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
    require_labels(batch, "projnce")
    kind = "label"
    with full_precision(batch):
        logits = similarity_logits(batch.anchors, batch.candidates, temperature)  # [n, N]
        columns = batch.softmax_columns(kind)
        rows = torch.arange(batch.anchor_index.shape[0], device=logits.device)
        reuse = {}
        if projection == "centroid":  # g- = z: minus logits are the similarity logits
            plus = similarity_logits(batch.anchors, _centroid_plus(batch), temperature)
            plus_own = plus[rows, batch.anchor_index]  # before the softmax masks self
            lse_minus, minus_probs = row_softmax_(logits, columns)
            lse_plus = row_softmax_(plus, columns)[0]
            reuse = {"lse": lse_minus, "probs": minus_probs}
        else:  # g+ = g- per label group: [n, G] logits suffice
            projected = _group_projection(batch, projection, bandwidth, kernel_metric,
                                          class_embeddings)
            _, groups, _ = batch.group_index(kind)
            group_logits = similarity_logits(batch.anchors, projected, temperature)  # [n, G]
            plus_own = group_logits[rows, groups[batch.anchor_index]]
            if batch.num_negatives is None:
                lse_minus = _group_lse(batch, group_logits)
            else:
                lse_minus = row_softmax_(group_logits[:, groups], columns)[0]
            lse_plus = lse_minus  # the same projection on both sides
        i_proj = lse_minus - plus_own  # [n]
        adjustment = torch.exp(lse_plus - lse_minus)  # [n]; exactly 1 when g+ = g-
        loss = batch.anchor_mean(i_proj + adjustment, kind)
        extra = {"adjustment": batch.anchor_mean(adjustment, kind),
                 "i_proj": batch.anchor_mean(i_proj, kind)}
        return finish(batch, loss, logits, kind, temperature, extra=extra, **reuse)
