"""Representation diagnostics (docs/evaluation.md). Inputs are feature matrices [n, d] and
integer labels [n]; every function L2-normalises the features first."""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from scipy.special import digamma
from scipy.stats import spearmanr
from torch import Tensor

BLOCK = 4096


def target_noise_margin(train: Tensor, train_labels: Tensor, test: Tensor,
                        test_labels: Tensor) -> dict[str, object]:
    """SINCERE's margin: for each test embedding, the cosine to its nearest training
    embedding of the same class and of any other class; margin = median(same) -
    median(other). Returns both [n] arrays too (for the histograms)."""
    bank, train_labels = F.normalize(train.float(), dim=1), train_labels.long()
    queries = F.normalize(test.float(), dim=1)
    same, other = [], []
    for start in range(0, len(queries), BLOCK):
        sims = queries[start:start + BLOCK] @ bank.T
        match = test_labels[start:start + BLOCK, None].long() == train_labels[None]
        same.append(sims.masked_fill(~match, -math.inf).max(1).values)
        other.append(sims.masked_fill(match, -math.inf).max(1).values)
    same_t, other_t = torch.cat(same), torch.cat(other)
    return {"margin": float(same_t.median() - other_t.median()),
            "same_median": float(same_t.median()), "other_median": float(other_t.median()),
            "same": same_t.numpy(), "other": other_t.numpy()}


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


def alignment_uniformity(z: Tensor, labels: Tensor, max_samples: int,
                         seed: int = 0) -> dict[str, float]:
    """Wang & Isola (2020): alignment E ||f(x) - f(y)||^2 over positive pairs (here: pairs
    of the same class), uniformity log E exp(-2 ||f(x) - f(y)||^2) over all pairs."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randperm(len(z), generator=gen)[:max_samples]
    r, y = F.normalize(z[rows].float(), dim=1), labels[rows]
    sq = (2 - 2 * (r @ r.T)).clamp(min=0)
    off = ~torch.eye(len(r), dtype=torch.bool)
    same = (y[:, None] == y[None]) & off
    uniformity = torch.logsumexp(-2 * sq[off], 0) - math.log(int(off.sum()))
    return {"alignment": float(sq[same].mean()), "uniformity": float(uniformity)}


def knn_mutual_information(z: Tensor, labels: Tensor, k: int, max_samples: int,
                           seed: int = 0) -> float:
    """I(Z; C) in nats by Ross (2014)'s nearest-neighbour estimator for a continuous Z and a
    discrete C: psi(N) - <psi(N_c)> + psi(k) - <psi(m)>, with m the number of points of any
    class within the distance to the k-th same-class neighbour."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randperm(len(z), generator=gen)[:max_samples]
    r, y = F.normalize(z[rows].double(), dim=1), labels[rows]
    counts = {int(c): int((y == c).sum()) for c in y.unique()}
    keep = torch.tensor([counts[int(c)] > k for c in y])
    r, y = r[keep], y[keep]
    dist = torch.cdist(r, r)
    dist.fill_diagonal_(math.inf)
    same = y[:, None] == y[None]
    radius = dist.masked_fill(~same, math.inf).kthvalue(k, dim=1).values
    m = (dist <= radius[:, None]).sum(1).numpy()
    class_sizes = np.array([counts[int(c)] for c in y])
    return float(digamma(len(r)) - digamma(class_sizes).mean() + digamma(k)
                 - digamma(m).mean())
