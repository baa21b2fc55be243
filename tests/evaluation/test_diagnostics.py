"""Diagnostics on synthetic embeddings with known answers."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from evaluation.diagnostics import (
    alignment_uniformity,
    class_geometry,
    knn_mutual_information,
    learned_similarity,
    rank_correlation,
    target_noise_margin,
)


def simplex_etf(classes: int) -> torch.Tensor:
    """C unit vectors with pairwise cosine exactly -1/(C-1)."""
    vertices = torch.eye(classes, dtype=torch.float64) - 1.0 / classes
    return vertices / vertices.norm(dim=1, keepdim=True)


def test_simplex_etf_reaches_the_bound_with_zero_variance():
    labels = torch.arange(6).repeat_interleave(20)
    z = simplex_etf(6)[labels] * 3.0  # scale does not matter: features are normalised
    geometry = class_geometry(z, labels)
    assert geometry["class_mean_cosine"] == pytest.approx(-1 / 5, abs=1e-6)
    assert geometry["etf_cosine"] == pytest.approx(-0.2)
    assert geometry["intra_class_variance"] == pytest.approx(0.0, abs=1e-10)


def test_intra_class_variance_of_known_spread():
    # two points per class at angles +-a around the class direction: ||r - mean||^2 =
    # sin(a)^2 for each
    a = 0.3
    z = torch.tensor([[math.cos(a), math.sin(a)], [math.cos(a), -math.sin(a)],
                      [-math.cos(a), math.sin(a)], [-math.cos(a), -math.sin(a)]])
    geometry = class_geometry(z, torch.tensor([0, 0, 1, 1]))
    assert geometry["intra_class_variance"] == pytest.approx(math.sin(a) ** 2, rel=1e-5)
    assert geometry["class_mean_cosine"] == pytest.approx(-1.0, abs=1e-6)


def test_margin_of_constructed_neighbours():
    # test points sit exactly on their class direction; the other class is at 60 degrees
    e0, e1 = torch.tensor([1.0, 0.0]), torch.tensor([0.5, math.sqrt(3) / 2])
    train = torch.stack([e0, e1, e0 * 2, e1 * 3])
    train_labels = torch.tensor([0, 1, 0, 1])
    result = target_noise_margin(train, train_labels, torch.stack([e0, e1]),
                                 torch.tensor([0, 1]))
    assert result["same_median"] == pytest.approx(1.0)
    assert result["other_median"] == pytest.approx(0.5)
    assert result["margin"] == pytest.approx(0.5)


def test_learned_similarity_and_rank_correlation():
    directions = torch.tensor([[1.0, 0.0], [0.8, 0.6], [0.0, 1.0]])
    labels = torch.arange(3).repeat_interleave(5)
    learned = learned_similarity(directions[labels], labels, [0, 1, 2], samples_per_class=4)
    np.testing.assert_allclose(learned, (directions @ directions.T).numpy(), atol=1e-6)
    target = np.array([[1.0, 0.9, 0.1], [0.9, 1.0, 0.5], [0.1, 0.5, 1.0]])
    assert rank_correlation(learned, target) == pytest.approx(1.0)
    assert rank_correlation(learned, -target) == pytest.approx(-1.0)


def test_alignment_uniformity_of_collapsed_classes():
    labels = torch.arange(4).repeat_interleave(10)
    z = simplex_etf(4)[labels]
    result = alignment_uniformity(z, labels, max_samples=1000)
    assert result["alignment"] == pytest.approx(0.0, abs=1e-6)
    # pairs: same class distance 0, other class ||a-b||^2 = 2 - 2(-1/3) = 8/3
    n, same = 40, 40 * 9
    expected = math.log((same + (n * (n - 1) - same) * math.exp(-2 * 8 / 3)) / (n * (n - 1)))
    assert result["uniformity"] == pytest.approx(expected, rel=1e-5)


def test_knn_mutual_information_separated_vs_random():
    gen = torch.Generator().manual_seed(0)
    labels = torch.arange(4).repeat_interleave(200)
    separated = simplex_etf(4)[labels] + 0.05 * torch.randn(800, 4, generator=gen,
                                                            dtype=torch.float64)
    assert knn_mutual_information(separated, labels, 3, 5000) == pytest.approx(math.log(4),
                                                                                abs=0.05)
    noise = torch.randn(800, 4, generator=gen, dtype=torch.float64)
    assert abs(knn_mutual_information(noise, labels, 3, 5000)) < 0.05


def clouds(n: int, classes: int, dim: int = 8, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, classes, (n,), generator=gen)
    centres = torch.randn(classes, dim, generator=gen, dtype=torch.float64)
    return centres[labels] + 0.8 * torch.randn(n, dim, generator=gen, dtype=torch.float64), labels


def test_margin_in_small_blocks_equals_a_loop_over_pairs():
    train, train_labels = clouds(300, 5)
    test, test_labels = clouds(70, 5, seed=1)
    result = target_noise_margin(train, train_labels, test, test_labels,
                                 block_bytes=40 * 32)  # 40-column blocks, a short last one
    unit_train = train / train.norm(dim=1, keepdim=True)
    same, other = [], []
    for query, label in zip(test / test.norm(dim=1, keepdim=True), test_labels, strict=True):
        sims = [float(query @ row) for row in unit_train]
        same.append(max(s for s, c in zip(sims, train_labels, strict=True) if c == label))
        other.append(max(s for s, c in zip(sims, train_labels, strict=True) if c != label))
    np.testing.assert_allclose(result["same"], same, rtol=0, atol=1e-12)
    np.testing.assert_allclose(result["other"], other, rtol=0, atol=1e-12)
    lower_median = float(torch.tensor(same, dtype=torch.float64).median()
                         - torch.tensor(other, dtype=torch.float64).median())  # torch: lower
    assert result["margin"] == pytest.approx(lower_median, abs=1e-12)


def dense_alignment_uniformity(r: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    r = r / r.norm(dim=1, keepdim=True)
    sq = (2 - 2 * (r @ r.T)).clamp(min=0)
    off = ~torch.eye(len(r), dtype=torch.bool)
    same = (y[:, None] == y[None]) & off
    return (float(sq[same].mean()),
            float(torch.logsumexp(-2 * sq[off], 0) - math.log(int(off.sum()))))


def test_alignment_uniformity_in_blocks_equals_the_dense_products():
    z, labels = clouds(257, 6)
    result = alignment_uniformity(z, labels, max_samples=1000, block_bytes=257 * 32 * 10)
    rows = torch.randperm(257, generator=torch.Generator().manual_seed(0))
    alignment, uniformity = dense_alignment_uniformity(z[rows], labels[rows])
    assert result["alignment"] == pytest.approx(alignment, rel=1e-12)
    assert result["uniformity"] == pytest.approx(uniformity, rel=1e-12)


def test_mutual_information_in_blocks_equals_one_block():
    z, labels = clouds(400, 4)
    whole = knn_mutual_information(z, labels, 3, 5000, block_bytes=2**30)
    assert knn_mutual_information(z, labels, 3, 5000, block_bytes=400 * 32 * 7) == whole
