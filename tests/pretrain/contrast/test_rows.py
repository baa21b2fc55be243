"""The row reductions' helpers against torch's own reductions."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from pretrain.contrast import tiles
from pretrain.contrast.columns import MASKED_LOGIT
from pretrain.contrast.rows import (
    logsumexp,
    logsumexp_both_ways,
    logsumexp_with_positives,
    masked_logsumexp,
)
from tests.pretrain.objectives.batches import batch_of


def test_masked_logsumexp_equals_logsumexp_over_the_kept_entries():
    """float64, rows with one, some and no entries kept; the left-out entries' 80-below
    stand-ins leave no trace at double precision, even beside very negative kept values."""
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(6, 500, generator=gen, dtype=torch.float64) * 20
    values[1, :3] = torch.tensor([-300.0, -320.0, -290.0])
    drop = torch.rand(6, 500, generator=gen) < 0.99
    drop[0] = True
    drop[0, 7] = False  # one kept entry
    drop[1] = True
    drop[1, :3] = False  # kept entries far below the others
    drop[5] = True  # none kept
    want = values.masked_fill(drop, float("-inf")).logsumexp(1)
    got = masked_logsumexp(values, drop)
    torch.testing.assert_close(got[:5], want[:5], rtol=1e-15, atol=0)
    assert got[5].item() == MASKED_LOGIT


@pytest.fixture(params=[False, True], ids=["one-row-block", "row-blocks-of-3"])
def row_blocks(request, monkeypatch) -> None:
    if request.param:
        monkeypatch.setattr(tiles, "CPU_BLOCK_ELEMENTS", 3 * 4)


@pytest.mark.parametrize("anchors", ["every-row", "rows-4-to-11"])
@pytest.mark.parametrize("tile_size", [None, 1, 4, 7])
def test_column_lse_equals_the_transposed_rows_logsumexp(tile_size, anchors, row_blocks):
    """Each anchor's own column read down every candidate, in float64, equals the dense
    logsumexp down the kept entries of that column of the plain logits (views of one
    instance left out), with the same gradients for the embeddings, the texts and a
    learnable tau, the rows' own log-sum-exp also carrying gradient: from one walk of the
    tiles when every row is an anchor, from a second reduction when the batch is dense or
    the anchors are a rank's share."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.arange(8).repeat_interleave(2)[torch.randperm(16, generator=gen)]
    z = F.normalize(torch.randn(16, 5, dtype=torch.float64, generator=gen), dim=1)
    text = F.normalize(torch.randn(16, 5, dtype=torch.float64, generator=gen), dim=1)
    row_weight, column_weight = torch.rand(2, 16, dtype=torch.float64, generator=gen)
    own = slice(0, 16) if anchors == "every-row" else slice(4, 12)
    results = []
    for plain in (True, False):
        leaves = (z.clone().requires_grad_(), text.clone().requires_grad_(),
                  torch.tensor(0.3, dtype=torch.float64, requires_grad=True))
        if plain:
            other_view = (ids[:, None] == ids[None, :]) & ~torch.eye(16, dtype=torch.bool)
            image, texts = F.normalize(leaves[0], dim=1), F.normalize(leaves[1], dim=1)
            logits = (image @ texts.T / leaves[2]).masked_fill(other_view, float("-inf"))
            lse, column_lse = logits.logsumexp(1)[own], logits.logsumexp(0)[own]
        else:
            batch = dataclasses.replace(
                batch_of(leaves[0], ids, text=leaves[1], tile_size=tile_size),
                anchor_index=torch.arange(16)[own], anchor_start=own.start)
            rows, column_lse = logsumexp_both_ways(batch, batch.text, "instance",
                                                   over="negatives_and_self",
                                                   temperature=leaves[2])
            lse = rows.lse
        total = (row_weight[own] * lse).sum() + (column_weight[own] * column_lse).sum()
        results.append((lse, column_lse, torch.autograd.grad(total, leaves)))
    (*want, want_grads), (*got, got_grads) = results
    for got_value, want_value in zip([*got, *got_grads], [*want, *want_grads], strict=True):
        torch.testing.assert_close(got_value, want_value, rtol=1e-12, atol=1e-12)


def _kept_columns(over: str, labels: torch.Tensor) -> torch.Tensor:
    """[N, N] the columns each row's reduction keeps, as ``over`` is documented."""
    same = labels[:, None] == labels[None, :]
    own = torch.eye(len(labels), dtype=torch.bool)
    return {"others": ~own, "negatives": ~same, "negatives_and_self": ~same | own}[over]


@pytest.mark.parametrize("over", ["others", "negatives", "negatives_and_self"])
@pytest.mark.parametrize("tile_size", [None, 3])
def test_over_names_the_columns_of_each_row(over, tile_size):
    """float64: each ``over`` equals the plain logsumexp over the columns its docstring
    names, with label keys, dense and tiled, values and gradients."""
    gen = torch.Generator().manual_seed(3)
    labels = torch.randint(0, 4, (12,), generator=gen)
    z = torch.randn(12, 5, dtype=torch.float64, generator=gen)
    grads = []
    for plain in (True, False):
        leaf = z.clone().requires_grad_()
        if plain:
            unit = F.normalize(leaf, dim=1)
            logits = unit @ unit.T / 0.5
            lse = logits.masked_fill(~_kept_columns(over, labels), float("-inf")).logsumexp(1)
        else:
            batch = batch_of(leaf, torch.arange(12), labels=labels, tile_size=tile_size)
            lse = logsumexp(batch, batch.anchors, batch.candidates, "label", over=over,
                            temperature=0.5).lse
        grads.append((lse, *torch.autograd.grad(lse.square().sum(), leaf)))
    for got, want in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_over_rejects_an_unknown_set_of_columns():
    batch = batch_of(torch.randn(4, 3), torch.arange(4))
    with pytest.raises(ValueError, match="over='positives'"):
        logsumexp(batch, batch.anchors, batch.candidates, "instance", over="positives")


@pytest.mark.parametrize("num_negatives", [None, 3])
@pytest.mark.parametrize("tile_size", [None, 1, 5])
def test_logsumexp_with_positives_adds_the_plain_logsumexp_over_the_positives(tile_size,
                                                                             num_negatives):
    """float64: the positives' log-sum-exp of each row is the plain one over the other
    samples of its class (MASKED_LOGIT for a row with none), dense and tiled, and the
    row's own log-sum-exp is :func:`logsumexp`'s, with or without a negatives subset."""
    gen = torch.Generator().manual_seed(4)
    labels = torch.tensor([0, 0, 1, 2, 2, 2, 3, 1, 0, 4])  # class 4: a row with none
    z = torch.randn(10, 5, dtype=torch.float64, generator=gen)
    batch = batch_of(z, torch.arange(10), labels=labels, tile_size=tile_size,
                     num_negatives=num_negatives)
    rows, positive_lse = logsumexp_with_positives(batch, "label", over="negatives",
                                                  temperature=0.3)
    unit = F.normalize(z, dim=1)
    logits = unit @ unit.T / 0.3
    positive = (labels[:, None] == labels[None, :]) & ~torch.eye(10, dtype=torch.bool)
    want = logits.masked_fill(~positive, float("-inf")).logsumexp(1)
    has = positive.any(1)
    torch.testing.assert_close(positive_lse[has], want[has], rtol=1e-12, atol=1e-12)
    assert (positive_lse[~has] == MASKED_LOGIT).all()
    alone = logsumexp(batch, batch.anchors, batch.candidates, "label", over="negatives",
                      temperature=0.3)
    torch.testing.assert_close(rows.lse, alone.lse, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(rows.ess, alone.ess, rtol=1e-12, atol=1e-12)
