"""Class projections g(c) for ProjNCE (Jeong & Hero, Sec. 3): one vector per label group.

Each function returns [G, D] for the G label groups of ``ContrastiveBatch.group_index``
(sorted distinct labels), computed from the *global* batch so that every rank agrees.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

KernelMetric = Literal["l1", "l2", "cos"]


def _pair_distance(a: Tensor, b: Tensor, metric: KernelMetric) -> Tensor:
    if metric == "l1":
        return (a - b).abs().sum(1)
    if metric == "l2":
        return (a - b).norm(dim=1)
    return 0.5 - 0.5 * (a * b).sum(1)


def kernel_class_means(candidates: Tensor, groups: Tensor, num_groups: int,
                       bandwidth: float, metric: KernelMetric = "l1",
                       tile_size: int | None = None) -> Tensor:
    """Nadaraya-Watson class means f_hat(c) (eq. 16-17) with K(t) = 1 - t^2 on [0, 1].

    ``candidates`` [N, D] unit vectors, ``groups`` [N] group of each. Weights
    w_jm = K(d(z_j, z_m) / h); NW(c | z_j) = sum_m w_jm 1{g_m = c} / sum_m w_jm;
    f_hat(c) = sum_j NW(c | z_j) z_j / sum_j NW(c | z_j). The kernel's compact support
    keeps this sparse: only pairs with d < h carry weight, found from the cosine
    similarity (for l1, ||u - v||_1 >= ||u - v||_2 bounds the search), then weighted
    exactly with gradient. The 1/h factor of K_h cancels in the ratio. With ``tile_size``
    the search runs over [T, T] blocks of the similarity matrix instead of [N, N].
    """
    n = candidates.shape[0]
    rows, cols = _near_pairs(candidates, bandwidth, metric, tile_size or n)
    dist = _pair_distance(candidates[rows], candidates[cols], metric)
    weight = (1 - (dist / bandwidth) ** 2).clamp(min=0)  # [P]
    row_sum = torch.ones(n, dtype=candidates.dtype, device=candidates.device)
    row_sum = row_sum.index_add(0, rows, weight)  # K(0) = 1 for the sample itself
    votes = F.one_hot(groups, num_groups).to(candidates.dtype)  # [N, G]
    votes = votes.index_put((rows, groups[cols]), weight, accumulate=True)
    posterior = votes / row_sum[:, None]  # [N, G] NW(c | z_j)
    return (posterior.T @ candidates) / posterior.sum(0)[:, None]


def _near_pairs(candidates: Tensor, bandwidth: float, metric: KernelMetric,
                tile_size: int) -> tuple[Tensor, Tensor]:
    """([P], [P]) the pairs j != m that may lie within ``bandwidth``, block by block."""
    # cos: d < h <=> sim > 1 - 2h; l1/l2: ||u - v||_2 < h <=> sim > 1 - h^2 / 2
    threshold = (1 - 2 * bandwidth if metric == "cos" else 1 - bandwidth**2 / 2) - 1e-4
    found_rows, found_cols = [], []
    n = candidates.shape[0]
    with torch.no_grad():
        for row in range(0, n, tile_size):
            for col in range(0, n, tile_size):
                block = candidates[row:row + tile_size] @ candidates[col:col + tile_size].T
                near_rows, near_cols = (block > threshold).nonzero(as_tuple=True)
                near_rows, near_cols = near_rows + row, near_cols + col
                off_diagonal = near_rows != near_cols
                found_rows.append(near_rows[off_diagonal])
                found_cols.append(near_cols[off_diagonal])
    return torch.cat(found_rows), torch.cat(found_cols)


def median_class_embeddings(candidates: Tensor, groups: Tensor, counts: Tensor) -> Tensor:
    """Coordinate-wise lower median of each group's embeddings (ProjNCE-med, eq. 33).

    For an even count the lower of the two middle values is taken (``torch.median``'s
    convention); the gradient flows to the selected element of each coordinate.
    """
    num_groups, dim = counts.shape[0], candidates.shape[1]
    order = torch.argsort(groups, stable=True)
    starts = torch.cumsum(counts, 0) - counts
    slot = torch.arange(groups.shape[0], device=groups.device) - starts[groups[order]]
    padded = candidates.new_full((num_groups, int(counts.max()), dim), float("nan"))
    padded = padded.index_put((groups[order], slot), candidates[order])
    return padded.nanmedian(dim=1).values


def learned_class_embeddings(class_embeddings: Tensor, group_labels: Tensor) -> Tensor:
    """Rows of a trainable [C, D] class-embedding matrix (ProjNCE-MLP, eq. 34), L2-normalised.

    Normalising keeps psi(z, g) = z . g / tau a cosine, like every other critic here; an
    unnormalised matrix could lower the loss by growing without bound.
    """
    if int(group_labels.max()) >= class_embeddings.shape[0] or int(group_labels.min()) < 0:
        raise ValueError(
            f"projnce learned: labels must lie in [0, {class_embeddings.shape[0]}) "
            "of class_embeddings")
    return F.normalize(class_embeddings[group_labels], dim=1)
