"""The row reductions' helpers against torch's own reductions."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pretrain.losses import tiles
from pretrain.losses.columns import MASKED_LOGIT, ColumnSet
from pretrain.losses.rows import masked_logsumexp, row_logsumexp
from tests.pretrain.losses.batches import batch_of


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


@pytest.mark.parametrize("tile_size", [1, 4, 7])
def test_column_lse_equals_the_transposed_rows_logsumexp(tile_size, row_blocks):
    """A tiled pass asked for each column's log-sum-exp over the anchors gives, in float64,
    the dense logsumexp down the kept entries of every column (views of one instance left
    out), and the same gradients for the anchors, the columns and a learnable tau, with
    the rows' own log-sum-exp also carrying gradient."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.arange(8).repeat_interleave(2)[torch.randperm(16, generator=gen)]
    z = F.normalize(torch.randn(16, 5, dtype=torch.float64, generator=gen), dim=1)
    text = F.normalize(torch.randn(16, 5, dtype=torch.float64, generator=gen), dim=1)
    row_weight, column_weight = torch.rand(2, 16, dtype=torch.float64, generator=gen)
    columns = ColumnSet("instance", positives=False, self_column=True)
    results = []
    for width in (None, tile_size):
        leaves = (z.clone().requires_grad_(), text.clone().requires_grad_(),
                  torch.tensor(0.3, dtype=torch.float64, requires_grad=True))
        batch = batch_of(leaves[0], ids, text=leaves[1], tile_size=width)
        if width is None:
            logits = batch.columns(columns).apply(batch.anchors @ batch.text.T / leaves[2],
                                                  float("-inf"))
            lse, column_lse = logits.logsumexp(1), logits.logsumexp(0)
        else:
            rows = row_logsumexp(batch, batch.anchors, batch.text, columns,
                                 temperature=leaves[2], column_lse=True)
            lse, column_lse = rows.lse, rows.column_lse
        total = (row_weight * lse).sum() + (column_weight * column_lse).sum()
        results.append((lse, column_lse, torch.autograd.grad(total, leaves)))
    (*dense, dense_grads), (*tiled, tiled_grads) = results
    for got, want in zip([*tiled, *tiled_grads], [*dense, *dense_grads], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("options", [{"num_negatives": 3}, {"tile_size": None}],
                         ids=["negatives-subset", "dense"])
def test_column_lse_is_refused_where_columns_are_not_transposed_rows(options):
    gen = torch.Generator().manual_seed(2)
    z = torch.randn(8, 4, dtype=torch.float64, generator=gen)
    batch = batch_of(z, torch.arange(8), text=z.flip(0), **{"tile_size": 4, **options})
    with pytest.raises(ValueError, match="column_lse"):
        row_logsumexp(batch, batch.anchors, batch.text,
                      ColumnSet("instance", positives=False, self_column=True), column_lse=True)
