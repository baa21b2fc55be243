"""Representation diagnostics (docs/evaluation.md). Inputs are feature matrices [n, d] and
integer labels [n]; every function L2-normalises the features first.

Pairwise products ([queries, bank] or [n, n]) run in blocks of at most ``block_bytes``
(``eval.block_mib``), so memory is bounded by the budget, not by the bank; each block
holds the scores and their masks (``CELL_BYTES`` a pair). Blocking changes no result:
maxima, k-th values and counts are per row, and the log-sum-exp is merged exactly."""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from scipy.special import digamma
from scipy.stats import spearmanr
from torch import Tensor

BLOCK_BYTES = 256 * 2**20  # default score block (eval.block_mib)
CELL_BYTES = 32  # a pair: its score and a masked copy (float64 at most) and two masks
QUERY_ROWS = 4096  # query rows of a [queries, bank] block, at most


def block_rows(columns: int, block_bytes: int) -> int:
    """Rows of a [rows, columns] block within ``block_bytes``."""
    return max(1, block_bytes // (max(1, columns) * CELL_BYTES))


def unit(z: Tensor) -> Tensor:
    """Rows L2-normalised, in float32 or float64 (the input's precision if higher)."""
    return F.normalize(z if z.dtype == torch.float64 else z.float(), dim=1)


def target_noise_margin(train: Tensor, train_labels: Tensor, test: Tensor,
                        test_labels: Tensor,
                        block_bytes: int = BLOCK_BYTES) -> dict[str, object]:
    """SINCERE's margin: for each test embedding, the cosine to its nearest training
    embedding of the same class and of any other class; margin = median(same) -
    median(other). Returns both [n] arrays too (for the histograms). The bank is read in
    column blocks and normalised block by block (no normalised copy of it)."""
    queries, train_labels = unit(test), train_labels.long()
    rows = min(QUERY_ROWS, len(queries))
    columns = block_rows(rows, block_bytes)
    same = torch.full((len(queries),), -math.inf, dtype=queries.dtype)
    other = same.clone()
    for first in range(0, len(train), columns):
        bank = unit(train[first:first + columns]).to(queries.dtype)
        labels = train_labels[first:first + columns]
        for start in range(0, len(queries), rows):
            sims = queries[start:start + rows] @ bank.T
            match = test_labels[start:start + rows, None].long() == labels[None]
            block = slice(start, start + rows)
            same[block] = torch.maximum(same[block], torch.where(match, sims, -math.inf).amax(1))
            other[block] = torch.maximum(other[block],
                                         sims.masked_fill_(match, -math.inf).amax(1))
    return {"margin": float(same.median() - other.median()),
            "same_median": float(same.median()), "other_median": float(other.median()),
            "same": same.numpy(), "other": other.numpy()}


def class_means(z: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    classes = labels.unique()
    z = F.normalize(z.float(), dim=1)
    return classes, torch.stack([z[labels == c].mean(0) for c in classes])


def class_geometry(z: Tensor, labels: Tensor) -> dict[str, object]:
    """Intra-class variance Var_c = mean ||r - mean_c||^2 and the cosine similarity of class
    means, whose off-diagonal mean a simplex ETF puts at -1/(C-1) ("more negatives")."""
    classes, means = class_means(z, labels)
    r = F.normalize(z.float(), dim=1)
    variance = torch.stack([((r[labels == c] - m) ** 2).sum(1).mean()
                            for c, m in zip(classes, means, strict=True)])
    cosine = F.normalize(means, dim=1) @ F.normalize(means, dim=1).T
    count = len(classes)
    off = cosine[~torch.eye(count, dtype=torch.bool)]
    return {"intra_class_variance": float(variance.mean()),
            "class_mean_cosine": float(off.mean()) if count > 1 else float("nan"),
            "etf_cosine": -1.0 / (count - 1) if count > 1 else float("nan"),
            "class_mean_cosine_matrix": cosine.numpy(),
            "per_class_variance": variance.numpy()}


def learned_similarity(z: Tensor, labels: Tensor, classes: list[int],
                       samples_per_class: int, seed: int = 0) -> np.ndarray:
    """[G, G] mean pairwise cosine over the Cartesian product of up to ``samples_per_class``
    samples of each pair of classes (self pairs left out on the diagonal)."""
    gen = torch.Generator().manual_seed(seed)
    r = F.normalize(z.float(), dim=1)
    picked = []
    for c in classes:
        rows = (labels == c).nonzero().flatten()
        picked.append(r[rows[torch.randperm(len(rows), generator=gen)[:samples_per_class]]])
    out = np.zeros((len(classes), len(classes)))
    for a, za in enumerate(picked):
        for b, zb in enumerate(picked):
            sims = za @ zb.T
            if a == b:
                n = len(za)
                out[a, b] = float((sims.sum() - sims.diagonal().sum()) / max(1, n * (n - 1)))
            else:
                out[a, b] = float(sims.mean())
    return out


def rank_correlation(learned: np.ndarray, target: np.ndarray) -> float:
    """Spearman correlation over the off-diagonal class pairs (upper triangle)."""
    upper = np.triu_indices(len(learned), k=1)
    if len(upper[0]) < 2:
        return float("nan")
    return float(spearmanr(learned[upper], target[upper]).statistic)


def alignment_uniformity(z: Tensor, labels: Tensor, max_samples: int, seed: int = 0,
                         block_bytes: int = BLOCK_BYTES) -> dict[str, float]:
    """Wang & Isola (2020): alignment E ||f(x) - f(y)||^2 over positive pairs (here: pairs
    of the same class), uniformity log E exp(-2 ||f(x) - f(y)||^2) over all pairs; on a
    seeded subsample of ``max_samples`` rows, in row blocks."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randperm(len(z), generator=gen)[:max_samples]
    r, y = unit(z[rows]), labels[rows]
    step = block_rows(len(r), block_bytes)
    pair_sums, aligned, positives = [], 0.0, 0
    for start in range(0, len(r), step):
        sq = (2 - 2 * (r[start:start + step] @ r.T)).clamp(min=0)
        own = torch.arange(start, start + len(sq))
        off = torch.ones_like(sq, dtype=torch.bool)
        off[torch.arange(len(sq)), own] = False
        same = (y[own, None] == y[None]) & off
        pair_sums.append(torch.logsumexp(-2 * sq[off], 0))
        aligned += float(sq[same].double().sum())
        positives += int(same.sum())
    pairs = len(r) * (len(r) - 1)
    uniformity = torch.logsumexp(torch.stack(pair_sums), 0) - math.log(pairs)
    return {"alignment": aligned / positives if positives else float("nan"),
            "uniformity": float(uniformity)}


def knn_mutual_information(z: Tensor, labels: Tensor, k: int, max_samples: int,
                           seed: int = 0, block_bytes: int = BLOCK_BYTES) -> float:
    """I(Z; C) in nats by Ross (2014)'s nearest-neighbour estimator for a continuous Z and a
    discrete C: psi(N) - <psi(N_c)> + psi(k) - <psi(m)>, with m the number of points of any
    class within the distance to the k-th same-class neighbour. On a seeded subsample of
    ``max_samples`` rows; distances in row blocks."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randperm(len(z), generator=gen)[:max_samples]
    r, y = F.normalize(z[rows].double(), dim=1), labels[rows]
    counts = {int(c): int((y == c).sum()) for c in y.unique()}
    keep = torch.tensor([counts[int(c)] > k for c in y])
    r, y = r[keep], y[keep]
    step = block_rows(len(r), block_bytes)
    m = []
    for start in range(0, len(r), step):
        dist = torch.cdist(r[start:start + step], r)
        own = torch.arange(start, start + len(dist))
        dist[torch.arange(len(dist)), own] = math.inf
        same = y[own, None] == y[None]
        radius = dist.masked_fill(~same, math.inf).kthvalue(k, dim=1).values
        m.append((dist <= radius[:, None]).sum(1))
    class_sizes = np.array([counts[int(c)] for c in y])
    return float(digamma(len(r)) - digamma(class_sizes).mean() + digamma(k)
                 - digamma(torch.cat(m).numpy()).mean())
