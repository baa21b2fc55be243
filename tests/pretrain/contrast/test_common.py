"""The objectives' shared pieces against plain loops."""

from __future__ import annotations

import pytest
import torch

from pretrain.contrast import common
from pretrain.contrast.batch import ContrastiveBatch


@pytest.mark.parametrize("chunk", [3, 65536])  # rows of a temporary: many chunks, or one
def test_positive_logit_mean_equals_a_loop_over_pairs(monkeypatch, chunk):
    """The mean over each anchor's positives of z_i . z_p / tau, value and gradient, for
    anchors that are some of the candidates, groups of one to four, float64."""
    monkeypatch.setattr(common, "ROW_CHUNK", chunk)
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(11, 5, dtype=torch.float64, generator=gen).requires_grad_()
    ids = torch.tensor([0, 0, 1, 2, 2, 2, 2, 3, 3, 4, 1])
    anchors = torch.tensor([9, 1, 3, 4, 7, 10, 0])
    weights = torch.randn(len(anchors), dtype=torch.float64, generator=gen)
    batch = ContrastiveBatch(candidates=z, anchor_index=anchors, ids=ids)
    got, num_pos = common.positive_logit_mean(batch, "instance", 0.5)
    want = []
    for i in anchors.tolist():
        pairs = [z[i] @ z[p] for p in range(len(ids)) if ids[p] == ids[i] and p != i]
        want.append(sum(pairs) / max(1, len(pairs)) / 0.5 if pairs else z.new_zeros(()))
    want = torch.stack(want)
    torch.testing.assert_close(got, want, rtol=1e-14, atol=1e-14)
    assert num_pos.tolist() == [0, 1, 3, 3, 1, 1, 1]
    (grad,) = torch.autograd.grad(got @ weights, z)
    (want_grad,) = torch.autograd.grad(want @ weights, z)
    torch.testing.assert_close(grad, want_grad, rtol=1e-13, atol=1e-14)
