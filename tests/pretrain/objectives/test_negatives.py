"""``num_negatives = k``: a seeded, per-anchor, uniformly random subset of Neg(i)."""

from __future__ import annotations

import pytest
import torch

from pretrain.contrast.batch import ContrastiveBatch
from pretrain.objectives import batch_loss
from tests.pretrain.objectives import naive
from tests.pretrain.objectives.batches import batch_of


def big_batch(n_images: int = 40, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.arange(n_images).repeat_interleave(2)
    labels = ids % 7
    z = torch.randn(len(ids), 6, generator=gen, dtype=torch.float64).requires_grad_()
    return z, ids, labels


@pytest.mark.parametrize("kind", ["instance", "label"])
def test_each_anchor_keeps_exactly_k_negatives_and_all_positives(kind):
    z, ids, labels = big_batch()
    batch = batch_of(z, ids, labels, num_negatives=5, negatives_seed=3)
    full = batch_of(z, ids, labels)
    kept = batch.negative_mask(kind)
    assert (kept.sum(1) == 5).all()
    assert not (kept & ~full.negative_mask(kind)).any()  # only true negatives
    assert torch.equal(batch.positive_mask(kind), full.positive_mask(kind))


def test_subset_is_reproducible_and_changes_with_the_seed():
    z, ids, labels = big_batch()
    first = batch_of(z, ids, num_negatives=4, negatives_seed=1).negative_mask("instance")
    again = batch_of(z, ids, num_negatives=4, negatives_seed=1).negative_mask("instance")
    other = batch_of(z, ids, num_negatives=4, negatives_seed=2).negative_mask("instance")
    assert torch.equal(first, again)
    assert not torch.equal(first, other)


def test_subset_is_uniform_over_negatives():
    z, ids, _ = big_batch(n_images=10)
    counts = torch.zeros(len(ids), len(ids))
    trials = 3000
    for seed in range(trials):
        counts += batch_of(z, ids, num_negatives=3, negatives_seed=seed).negative_mask(
            "instance").double()
    negatives = batch_of(z, ids).negative_mask("instance")
    freq = counts[negatives] / trials  # expected 3 / 18 for every negative
    expected = 3 / 18
    sd = (expected * (1 - expected) / trials) ** 0.5
    assert (freq - expected).abs().max() < 5 * sd


def test_subset_of_a_row_does_not_depend_on_which_rank_holds_it():
    z, ids, labels = big_batch()
    whole = batch_of(z, ids, num_negatives=6, negatives_seed=9)
    rows = torch.arange(30, 55)
    part = ContrastiveBatch(candidates=whole.candidates, anchor_index=rows, ids=ids,
                            num_negatives=6, negatives_seed=9, world_size=3)
    assert torch.equal(part.negative_mask("instance"), whole.negative_mask("instance")[rows])


def test_k_larger_than_available_keeps_every_negative():
    z, ids, labels = big_batch(n_images=5)
    a, _ = batch_loss("supcon", z, ids, labels, num_negatives=1000, temperature=0.1)
    b, _ = batch_loss("supcon", z, ids, labels, temperature=0.1)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["infonce", "supcon", "sincere"])
def test_loss_with_subset_matches_naive_on_that_subset(name):
    z, ids, labels = big_batch(n_images=12)
    batch = batch_of(z, ids, labels, num_negatives=4, negatives_seed=5)
    kind = "instance" if name == "infonce" else "label"
    kept = batch.negative_mask(kind)
    loss, _ = batch_loss(name, z, ids, labels, temperature=0.2, num_negatives=4,
                         negatives_seed=5)
    keys = ids if name == "infonce" else labels
    if name == "sincere":
        reference = naive.sincere(z, labels, 0.2, negatives_kept=lambda i, j: bool(kept[i, j]))
    else:
        reference = naive.supcon(z, keys, 0.2, negatives_kept=lambda i, j: bool(kept[i, j]))
    torch.testing.assert_close(loss, reference)
    torch.testing.assert_close(torch.autograd.grad(loss, z)[0],
                               torch.autograd.grad(reference, z)[0])


def test_fewer_negatives_lower_the_infonce_loss():
    z, ids, _ = big_batch()
    losses = [batch_loss("infonce", z, ids, num_negatives=k, temperature=0.1)[0].item()
              for k in (1, 8, 78)]
    assert losses[0] < losses[1] < losses[2]
