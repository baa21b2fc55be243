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

import dataclasses
from dataclasses import dataclass
from typing import Literal

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
    projected_rows,
)

Projection = Literal["centroid", "kernel", "median", "learned"]
KernelMetric = Literal["l1", "l2", "cos"]


def plain_projnce(rows: BatchRows, tau: float | Tensor, projection: Projection,
                  bandwidth: float, kernel_metric: KernelMetric, neighbours: int,
                  class_embeddings: Tensor | None = None,
                  num_classes: int | None = None) -> Tensor:
    """ProjNCE as written, with ``projection``'s g+ and g- of ``rows.labels`` [N] (classes
    in [0, C), every one present) for ``rows.z`` [N, D]."""
    z, labels = F.normalize(rows.z, dim=1), rows.labels
    classes = num_classes or int(labels.max()) + 1
    if projection == "centroid":
        plus, minus = plain_centroid_projections(z, labels)
        return plain_projnce_of(z, labels, tau, plus, minus)
    if projection == "kernel":
        k = neighbours if neighbours < len(z) - 1 else None  # k >= N - 1: every other
        table = plain_kernel_class_means(z, labels, classes, bandwidth, kernel_metric, k)
    elif projection == "median":
        table = plain_median_class_embeddings(z, labels, classes)
    else:
        table = F.normalize(class_embeddings, dim=1)
    return plain_projnce_of(z, labels, tau, table[labels], table[labels])


def plain_kernel_class_means(z: Tensor, labels: Tensor, num_classes: int, bandwidth: float,
                             metric: KernelMetric, neighbours: int | None = None) -> Tensor:
    """The Nadaraya-Watson class means as written (eq. 16-17), K(t) = 1 - t^2 on [0, 1]:
    ``z`` [N, D] unit rows, ``labels`` [N] in [0, C); returns [C, D] (every class present).
    With ``neighbours`` = k, each sample weighs only its k most similar others (z_j . z_m)."""
    distance = {"l1": lambda: torch.cdist(z, z, p=1.0), "l2": lambda: torch.cdist(z, z),
                "cos": lambda: 0.5 - 0.5 * z @ z.T}[metric]()                # [N, N]
    self_pair = torch.eye(len(z), dtype=torch.bool, device=z.device)
    weight = torch.where(self_pair, 1.0, (1 - (distance / bandwidth) ** 2).clamp(min=0))
    if neighbours is not None:  # the k nearest by cosine, and the sample itself
        nearest = (z @ z.T).masked_fill(self_pair, float("-inf")).topk(neighbours).indices
        weight = weight * self_pair.scatter(1, nearest, True)
    one_hot = F.one_hot(labels, num_classes).to(z.dtype)                    # [N, C]
    posterior = weight @ one_hot / weight.sum(1, keepdim=True)              # NW(c | z_j)
    return posterior.T @ z / posterior.sum(0)[:, None]                      # f_hat(c)


def plain_median_class_embeddings(z: Tensor, labels: Tensor, num_classes: int) -> Tensor:
    """Each class's coordinate-wise lower median (eq. 33) as written: [C, D]."""
    return torch.stack([z[labels == c].sort(dim=0).values[((labels == c).sum() - 1) // 2]
                        for c in range(num_classes)])


def plain_projnce_of(z: Tensor, labels: Tensor, tau: float | Tensor, plus: Tensor,
                     minus: Tensor) -> Tensor:
    """ProjNCE as written: unit ``z`` [N, D], ``labels`` [N], and ``plus``, ``minus`` [N, D],
    the projections g+(y_k), g-(y_k) of every sample k; the mean of I_proj + R over anchors
    that have a positive."""
    self_pair = torch.eye(len(z), dtype=torch.bool, device=z.device)
    lse_minus = (z @ minus.T / tau).masked_fill(self_pair, float("-inf")).logsumexp(1)
    lse_plus = (z @ plus.T / tau).masked_fill(self_pair, float("-inf")).logsumexp(1)
    i_proj = lse_minus - (z * plus).sum(1) / tau                         # [N]
    adjustment = torch.exp(lse_plus - lse_minus)                         # R_i
    has_positive = ((labels[:, None] == labels[None, :]) & ~self_pair).any(1)
    return (i_proj + adjustment)[has_positive].mean()


def plain_centroid_projections(z: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """(g+, g-) [N, D] of ProjNCE's centroid for unit ``z``: the mean of the other samples
    of y_k (z_k alone in its class), and z_k."""
    mates = (labels[:, None] == labels[None, :]).to(z.dtype).fill_diagonal_(0)  # [N, N]
    count = mates.sum(1, keepdim=True)
    plus = torch.where(count > 0, mates @ z / count.clamp(min=1), z)
    return plus, z

@dataclass
class ProjNCEConfig:
    """``objective.projnce.*``."""

    # learned: a [C, D] class-embedding matrix trained with the encoder (ProjNCE-MLP)
    projection: Projection = "centroid"  # the class projection g(c)
    bandwidth: float = 0.5  # kernel: Nadaraya-Watson bandwidth h
    kernel_metric: KernelMetric = "l1"  # kernel: distance
    # exact while no sample has more than k others within h (metric kernel_truncated)
    neighbours: int = 64  # kernel: each sample weighs its k most similar others

    def validate(self) -> None:
        if not self.bandwidth > 0:
            raise InvalidValue("bandwidth", f"must be > 0, got {self.bandwidth}")
        if self.neighbours < 1:
            raise InvalidValue("neighbours", f"must be >= 1, got {self.neighbours}")


def projnce(batch: ContrastiveBatch, temperature: float | Tensor, *,
            projection: Projection, bandwidth: float, kernel_metric: KernelMetric,
            neighbours: int, class_embeddings: Tensor | None = None) -> ObjectiveOutput:
    """ProjNCE with the chosen projection; ``metrics["adjustment"]`` is the mean R (and
    ``metrics["kernel_truncated"]``, kernel only, the share of samples with more than
    ``neighbours`` others inside the bandwidth)."""
    if projection == "learned":
        if class_embeddings is None:
            raise ValueError("projnce learned: pass class_embeddings, a trainable [C, D] "
                             "tensor")
        # label groups are the matrix's C classes (labels outside [0, C) fail there)
        batch = dataclasses.replace(batch, num_classes=class_embeddings.shape[0])
    rows = projected_rows(batch, temperature, projection=projection, bandwidth=bandwidth,
                          kernel_metric=kernel_metric, neighbours=neighbours,
                          class_embeddings=class_embeddings)
    i_proj = rows.lse_minus - rows.plus_own  # [n]
    adjustment = torch.exp(rows.lse_plus - rows.lse_minus)  # [n]; exactly 1 when g+ = g-
    loss = batch.anchor_mean(i_proj + adjustment, "label")
    pos_mean, _ = positive_logit_mean(batch, "label", temperature)  # the monitors' only
    similarity = rows.similarity  # the plain similarity logits' row terms
    extra = {"adjustment": batch.anchor_mean(adjustment, "label"),
             "i_proj": batch.anchor_mean(i_proj, "label"), **rows.metrics}
    return finish(batch, loss, "label", temperature, extra=extra, pos_mean=pos_mean,
                  infonce=similarity.lse - pos_mean, ess=similarity.ess,
                  negative_logit_sum=similarity.negative_logit_sum)
