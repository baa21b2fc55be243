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

# per-class sums: beyond the vocabulary (docs/architecture.md)
from pretrain.losses.common import add_log_columns_, as_float
from pretrain.losses.projections import (
    KernelMetric,
    kernel_class_means,
    learned_class_embeddings,
    median_class_embeddings,
    plain_kernel_class_means,
    plain_median_class_embeddings,
)
from pretrain.losses.rows import RowTerms
from pretrain.losses.vocabulary import (
    BatchRows,
    ColumnSet,
    ContrastiveBatch,
    ObjectiveOutput,
    Temperature,
    finish,
    pair_logits,
    positive_logit_mean,
    row_logsumexp,
    scaled,
)

Projection = Literal["centroid", "kernel", "median", "learned"]


def plain_projnce(rows: BatchRows, tau: Temperature, projection: Projection,
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


def plain_projnce_of(z: Tensor, labels: Tensor, tau: Temperature, plus: Tensor,
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
                      kernel_metric: KernelMetric, neighbours: int,
                      class_embeddings: Tensor | None) -> tuple[Tensor, dict[str, Tensor]]:
    """[G, D] one projected vector per label group of the global batch, and the
    projection's own metrics."""
    values, groups, counts = batch.group_index("label")
    cand = as_float(batch.candidates)
    if projection == "kernel":  # its class posterior is [N, G]: give num_classes for G = C
        kernel = kernel_class_means(cand, groups, counts.shape[0], bandwidth, kernel_metric,
                                    neighbours, tile_size=batch.tile_size, valid=batch.valid)
        return kernel.means, {"kernel_truncated": kernel.truncated}
    if projection == "median":
        return median_class_embeddings(cand, groups, counts, batch.valid), {}
    return learned_class_embeddings(class_embeddings.to(cand.dtype), values), {}


def projnce(batch: ContrastiveBatch, temperature: Temperature, *,
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
    kind = "label"
    columns = ColumnSet(kind)
    projection_metrics: dict[str, Tensor] = {}
    anchors = scaled(batch.anchors, temperature)  # [n, D]
    if projection == "centroid":  # g- = z: minus logits are the similarity logits
        plus = _centroid_plus(batch)  # [N, D]
        plus_own = pair_logits(anchors, plus, batch.self_pairs())  # [n]
        minus = row_logsumexp(batch, anchors, batch.candidates, columns, monitors=True)
        lse_minus = minus.lse
        lse_plus = row_logsumexp(batch, anchors, plus, columns).lse
    else:  # g+ = g- per label group
        projected, projection_metrics = _group_projection(
            batch, projection, bandwidth, kernel_metric, neighbours,
            class_embeddings)  # [G, D]
        _, groups, _ = batch.group_index(kind)
        plus_own = pair_logits(anchors, projected, (batch.self_pairs()[0],
                                                    groups[batch.anchor_index]))
        if batch.num_negatives is None and (batch.tile_size is None
                                            or batch.classes is not None):
            # [n, G] logits suffice (tiled: G the C classes, not N slots)
            lse_minus = _group_lse(batch, anchors @ projected.T)
        else:
            lse_minus = row_logsumexp(batch, anchors, projected[groups], columns).lse
        lse_plus = lse_minus  # the same projection on both sides
        with torch.no_grad():  # the monitors read the plain similarity logits
            minus = row_logsumexp(batch, anchors.detach(), batch.candidates.detach(),
                                  columns, monitors=True)
    i_proj = lse_minus - plus_own  # [n]
    adjustment = torch.exp(lse_plus - lse_minus)  # [n]; exactly 1 when g+ = g-
    loss = batch.anchor_mean(i_proj + adjustment, kind)
    extra = {"adjustment": batch.anchor_mean(adjustment, kind),
             "i_proj": batch.anchor_mean(i_proj, kind), **projection_metrics}
    return finish(batch, loss, kind, temperature, extra=extra, **_monitors(
        batch, minus, temperature))


def _monitors(batch: ContrastiveBatch, minus: RowTerms,
              temperature: Temperature) -> dict[str, Tensor]:
    """The common monitors' inputs from the plain similarity logits' row terms."""
    pos_mean, _ = positive_logit_mean(batch, "label", temperature)
    return {"infonce": minus.lse - pos_mean, "pos_mean": pos_mean, "ess": minus.ess,
            "negative_logit_sum": minus.negative_logit_sum}
