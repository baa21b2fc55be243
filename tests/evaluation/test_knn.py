"""Weighted kNN against a brute-force numpy reference; saved indexes; IVF vs exact."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from evaluation.knn import build_index, even_blocks, knn_accuracy

KS = [1, 5, 10, 20, 50, 100, 200]


def naive_knn(bank, bank_labels, queries, k, temperature, num_classes):
    """Per query: cosine to every bank row, sort, vote exp(sim / T) per class."""
    bank = bank / np.linalg.norm(bank, axis=1, keepdims=True)
    predictions, top5 = [], []
    for q in queries:
        q = q / np.linalg.norm(q)
        sims = bank @ q
        order = np.argsort(-sims, kind="stable")[:k]
        votes = np.zeros(num_classes)
        for j in order:
            votes[bank_labels[j]] += np.exp(sims[j] / temperature)
        predictions.append(int(np.argmax(votes)))
        top5.append([c for c in np.argsort(-votes, kind="stable")[:5] if votes[c] > 0])
    return np.array(predictions), top5


@pytest.fixture
def data():
    rng = np.random.default_rng(0)
    centres = rng.normal(size=(12, 16))
    bank_labels = rng.integers(0, 12, 1500)
    query_labels = rng.integers(0, 12, 300)
    bank = centres[bank_labels] + 1.5 * rng.normal(size=(1500, 16))
    queries = centres[query_labels] + 1.5 * rng.normal(size=(300, 16))
    return bank, bank_labels, queries, query_labels


def test_exact_knn_equals_brute_force(data):
    bank, bank_labels, queries, query_labels = data
    index = build_index(torch.from_numpy(bank), "exact")
    results, predictions = knn_accuracy(index, torch.from_numpy(bank_labels),
                                        torch.from_numpy(queries), torch.from_numpy(query_labels),
                                        KS, 0.07, 12)
    for k in KS:
        expected, top5 = naive_knn(bank, bank_labels, queries, k, 0.07, 12)
        np.testing.assert_array_equal(predictions[k].numpy(), expected)
        assert results[f"k{k}"]["top1"] == pytest.approx(np.mean(expected == query_labels))
        in_top5 = np.mean([label in t for label, t in zip(query_labels, top5, strict=True)])
        assert results[f"k{k}"]["top5"] == pytest.approx(in_top5)
    assert 0.2 < results["k20"]["top1"] < 1.0  # a task that is neither trivial nor hopeless


def test_faiss_flat_agrees_with_exact(data):
    bank, bank_labels, queries, query_labels = (torch.from_numpy(x) for x in data)
    exact, pred_exact = knn_accuracy(build_index(bank.float(), "exact"), bank_labels,
                                     queries.float(), query_labels, KS, 0.07, 12)
    flat, pred_flat = knn_accuracy(build_index(bank.float(), "faiss_flat"), bank_labels,
                                   queries.float(), query_labels, KS, 0.07, 12)
    for k in KS:
        assert (pred_exact[k] == pred_flat[k]).float().mean() >= 0.99
        assert flat[f"k{k}"]["top1"] == pytest.approx(exact[f"k{k}"]["top1"], abs=0.01)


def test_an_ivf_index_is_saved_and_reused(data, tmp_path):
    bank = torch.from_numpy(data[0]).float()
    index = build_index(bank, "ivf", lists=16, probe=16, path=tmp_path / "ivf")
    index.save(tmp_path / "ivf")
    again = build_index(bank, "ivf", lists=16, probe=16, path=tmp_path / "ivf")
    assert not index.loaded and again.loaded
    sims, rows = index.search(bank[:20], 5)
    sims2, rows2 = again.search(bank[:20], 5)
    assert torch.equal(rows, rows2)
    assert (tmp_path / "ivf.faiss").is_file()


def test_ivf_probing_every_list_is_exact(data):
    bank, bank_labels, queries, query_labels = (torch.from_numpy(x) for x in data)
    exact = build_index(bank.float(), "exact")
    ivf = build_index(bank.float(), "ivf", lists=8, probe=8)
    _, rows_exact = exact.search(queries.float(), 10)
    _, rows_ivf = ivf.search(queries.float(), 10)
    assert (rows_exact == rows_ivf).float().mean() > 0.99


def test_votes_in_small_query_blocks_equal_one_block(data):
    bank, bank_labels, queries, query_labels = (torch.from_numpy(x) for x in data)
    index = build_index(bank.float(), "exact", block_bytes=4096)  # small mm blocks
    whole, pred_whole = knn_accuracy(index, bank_labels, queries.float(), query_labels, KS,
                                     0.07, 12)
    blocks, pred_blocks = knn_accuracy(index, bank_labels, queries.float(), query_labels, KS,
                                       0.07, 12, block_bytes=12 * 16 * 5)  # 5-query blocks
    assert blocks == whole
    for k in KS:
        assert (pred_blocks[k] == pred_whole[k]).all()


def test_an_ivf_index_added_in_small_blocks_equals_one_block(data):
    bank = torch.tensor(data[0], dtype=torch.float32)
    queries = torch.tensor(data[2], dtype=torch.float32)
    whole = build_index(bank, "ivf", lists=8, probe=4)
    blocks = build_index(bank, "ivf", lists=8, probe=4, bank_block_bytes=16 * 4 * 37)  # 37 rows
    assert blocks.cpu_index.ntotal == len(bank)
    for got, want in zip(blocks.search(queries, 10), whole.search(queries, 10), strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("kind", ["exact", "faiss_flat"])
@pytest.mark.parametrize("rows", [37, 10, 1500])  # 10: a block holds fewer than k rows
@pytest.mark.parametrize("chunk", [7, 1000])  # queries per [chunk, rows] score block
def test_exact_search_in_bank_blocks_finds_the_brute_force_neighbours(data, kind, rows, chunk):
    """The bank read ``rows`` rows at a time (each block's best merged with the best so
    far), the queries scored ``chunk`` at a time, finds for every query the k rows of
    largest cosine in float64, best first."""
    bank, _, queries, _ = data
    index = build_index(torch.tensor(bank, dtype=torch.float32), kind,
                        block_bytes=4 * chunk * min(rows, len(bank)),
                        bank_block_bytes=4 * bank.shape[1] * rows)
    sims, found = index.search(torch.tensor(queries, dtype=torch.float32), 20)
    unit = bank / np.linalg.norm(bank, axis=1, keepdims=True)
    cosine = (queries / np.linalg.norm(queries, axis=1, keepdims=True)) @ unit.T
    want = np.argsort(-cosine, axis=1, kind="stable")[:, :20]
    np.testing.assert_array_equal(found.numpy(), want)  # no ties in this data
    # float32 products of unit rows of 16 values: ~1e-7 each, never 1e-5
    np.testing.assert_allclose(sims.numpy(), np.take_along_axis(cosine, want, 1), atol=1e-5)


@pytest.mark.parametrize(("n", "most", "want"), [(100, 37, 34), (100, 100, 100), (100, 500, 100),
                                                  (101, 50, 34), (1, 1, 1), (7, 0, 1)])
def test_even_blocks_use_the_fewest_blocks_of_nearly_one_size(n, most, want):
    assert even_blocks(n, most) == want
