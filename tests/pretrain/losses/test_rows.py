"""The row reductions' helpers against torch's own reductions."""

from __future__ import annotations

import torch

from pretrain.losses.columns import MASKED_LOGIT
from pretrain.losses.rows import masked_logsumexp


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
