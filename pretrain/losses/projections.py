"""Class projections g(c) for ProjNCE (Jeong & Hero, Sec. 3): one vector per label group.

Each function returns [G, D] for the G label groups of ``ContrastiveBatch.group_index``
(sorted distinct labels), computed from the *global* batch so that every rank agrees.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

KernelMetric = Literal["l1", "l2", "cos"]


def plain_kernel_class_means(z: Tensor, labels: Tensor, num_classes: int, bandwidth: float,
                             metric: KernelMetric) -> Tensor:
    """The Nadaraya-Watson class means as written (eq. 16-17), K(t) = 1 - t^2 on [0, 1]:
    ``z`` [N, D] unit rows, ``labels`` [N] in [0, C); returns [C, D] (every class present)."""
    distance = {"l1": lambda: torch.cdist(z, z, p=1.0), "l2": lambda: torch.cdist(z, z),
                "cos": lambda: 0.5 - 0.5 * z @ z.T}[metric]()                # [N, N]
    self_pair = torch.eye(len(z), dtype=torch.bool, device=z.device)
    weight = torch.where(self_pair, 1.0, (1 - (distance / bandwidth) ** 2).clamp(min=0))
    one_hot = F.one_hot(labels, num_classes).to(z.dtype)                    # [N, C]
    posterior = weight @ one_hot / weight.sum(1, keepdim=True)              # NW(c | z_j)
    return posterior.T @ z / posterior.sum(0)[:, None]                      # f_hat(c)


def plain_median_class_embeddings(z: Tensor, labels: Tensor, num_classes: int) -> Tensor:
    """Each class's coordinate-wise lower median (eq. 33) as written: [C, D]."""
    return torch.stack([z[labels == c].sort(dim=0).values[((labels == c).sum() - 1) // 2]
                        for c in range(num_classes)])


def _pair_distance(a: Tensor, b: Tensor, metric: KernelMetric) -> Tensor:
    if metric == "l1":
        return (a - b).abs().sum(1)
    if metric == "l2":
        return (a - b).norm(dim=1)
    return 0.5 - 0.5 * (a * b).sum(1)


def kernel_class_means(candidates: Tensor, groups: Tensor, num_groups: int,
                       bandwidth: float, metric: KernelMetric = "l1",
                       tile_size: int | None = None, valid: Tensor | None = None) -> Tensor:
    """Nadaraya-Watson class means f_hat(c) (eq. 16-17) with K(t) = 1 - t^2 on [0, 1].

    ``candidates`` [N, D] unit vectors, ``groups`` [N] group of each. Weights
    w_jm = K(d(z_j, z_m) / h); NW(c | z_j) = sum_m w_jm 1{g_m = c} / sum_m w_jm;
    f_hat(c) = sum_j NW(c | z_j) z_j / sum_j NW(c | z_j) (0 for a group without members).
    The weights are computed over [T, T] blocks of the pair distances (T = ``tile_size``,
    all N without it), each block recomputed in the backward instead of saved, so memory
    stays O(N (D + G) + T^2) and no shape depends on how many pairs lie within h. The 1/h
    factor of K_h cancels in the ratio. ``valid`` [N] leaves padding rows out (they vote
    for no class).
    """
    n = candidates.shape[0]
    size = tile_size or n
    one_hot = F.one_hot(groups, num_groups).to(candidates.dtype)  # [N, G]
    real = torch.ones(n, dtype=candidates.dtype, device=candidates.device)
    if valid is not None:
        real = valid.to(candidates.dtype)
        one_hot = one_hot * real[:, None]
    votes, row_sums = [], []
    for row in range(0, n, size):
        block_votes = one_hot[row:row + size]  # K(0) = 1: the sample itself
        block_sum = torch.ones(block_votes.shape[0], dtype=candidates.dtype,
                               device=candidates.device)
        for col in range(0, n, size):
            total, voted = checkpoint(_block_votes, candidates[row:row + size],
                                      candidates[col:col + size], groups[col:col + size],
                                      num_groups,
                                      real[row:row + size, None] * real[None, col:col + size],
                                      row - col, bandwidth, metric, use_reentrant=False)
            block_sum, block_votes = block_sum + total, block_votes + voted
        votes.append(block_votes)
        row_sums.append(block_sum)
    posterior = torch.cat(votes) / torch.cat(row_sums)[:, None]  # [N, G] NW(c | z_j)
    mass = posterior.sum(0)[:, None]
    return (posterior.T @ candidates) / mass.clamp(min=torch.finfo(mass.dtype).tiny)


def _block_votes(rows: Tensor, cols: Tensor, col_groups: Tensor, num_groups: int,
                 real: Tensor, offset: int, bandwidth: float,
                 metric: KernelMetric) -> tuple[Tensor, Tensor]:
    """([R] sum of the kernel weights of each row over the block's other columns, [R, G]
    those weights summed per group of the columns, ``col_groups`` [C]); ``real`` [R, C] is
    0 where the row or the column is padding; ``offset`` = row start - column start places
    the diagonal (the sample itself, counted apart)."""
    weight = (1 - _scaled_square_distances(rows, cols, metric, bandwidth)).clamp(min=0) * real
    r = torch.arange(rows.shape[0], device=rows.device)
    c = torch.arange(cols.shape[0], device=rows.device)
    weight = weight.masked_fill(r[:, None] + offset == c[None, :], 0.0)
    voted = weight.new_zeros(weight.shape[0], num_groups).index_add(1, col_groups, weight)
    return weight.sum(1), voted


def _scaled_square_distances(rows: Tensor, cols: Tensor, metric: KernelMetric,
                             bandwidth: float) -> Tensor:
    """[R, C] (d / h)^2 between the rows of ``rows`` [R, D] and ``cols`` [C, D]. l2 and cos
    are matrix products (l2 squared as |a|^2 + |b|^2 - 2 a.b: no square root, whose
    gradient at a zero distance is infinite). l1 goes through torch.cdist, whose backward
    holds an [R, C, D] buffer on a GPU (34 GB at R = C = 8,192, D = 128 on an H100), so
    ``objective.tile_size`` (R = C = T) is what bounds it there."""
    if metric == "l2":
        square = (rows.square().sum(1)[:, None] + cols.square().sum(1)[None, :]
                  - 2 * rows @ cols.T).clamp(min=0)
        return square / bandwidth**2
    distance = (0.5 - 0.5 * rows @ cols.T if metric == "cos"
                else torch.cdist(rows, cols, p=1.0))
    return (distance / bandwidth) ** 2


def median_class_embeddings(candidates: Tensor, groups: Tensor, counts: Tensor,
                            valid: Tensor | None = None) -> Tensor:
    """Coordinate-wise lower median of each group's embeddings (ProjNCE-med, eq. 33).

    For an even count the lower of the two middle values is taken (``torch.median``'s
    convention); the gradient flows to the selected element of each coordinate. Sorted by
    value, then stably by group, each coordinate's rows are grouped in value order; each
    group's median is read at its start + (size - 1) // 2: fixed shapes throughout. A
    group without members gets an arbitrary finite row; padding rows (``valid`` [N]
    False) are sorted after every group.
    """
    if valid is not None:
        groups = torch.where(valid, groups, counts.shape[0])
    by_value = candidates.argsort(dim=0, stable=True)  # [N, D]
    by_group = groups[by_value].argsort(dim=0, stable=True)  # group-major, value order kept
    rows = by_value.gather(0, by_group)  # [N, D] rows sorted by (group, value)
    starts = torch.cumsum(counts, 0) - counts  # [G]
    middle = (starts + (counts - 1).clamp(min=0) // 2).clamp(max=candidates.shape[0] - 1)
    return candidates.gather(0, rows[middle])  # [G, D]


def learned_class_embeddings(class_embeddings: Tensor, group_labels: Tensor) -> Tensor:
    """Rows of a trainable [C, D] class-embedding matrix (ProjNCE-MLP, eq. 34), L2-normalised.

    Normalising keeps psi(z, g) = z . g / tau a cosine, like every other critic here; an
    unnormalised matrix could lower the loss by growing without bound. ``group_labels``
    [G] lie in [0, C) (the batch's label groups are the C classes; checked there).
    """
    return F.normalize(class_embeddings[group_labels], dim=1)
