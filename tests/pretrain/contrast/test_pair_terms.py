"""SINCERE's pair terms, softplus(lse_i - l_ip + eps) summed over each anchor's positives
(``pair_terms.py``), against torch's softplus in float64: over the whole range of its
argument, and on batches whose temperature puts pairs past the floor, dense and tiled."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pretrain.contrast.columns import MASKED_LOGIT
from pretrain.contrast.pair_terms import FLOOR, softplus_sum_
from pretrain.objectives import BatchRows, batch_loss, objective_spec
from tests.pretrain.objectives.conftest import make_multiview_batch


def test_softplus_sum_equals_softplus_over_the_whole_range():
    """Every y from 300 below the floor to 60 above 0, each row summed; the entries set to
    -MASKED_LOGIT add nothing. float32's own resolution near 1 bounds the error there."""
    y = torch.linspace(FLOOR - 300, 60, 4001, dtype=torch.float64).reshape(1, -1)
    rows = torch.cat([y, y.flip(1), torch.full_like(y, -MASKED_LOGIT)])
    rows[1, ::3] = -MASKED_LOGIT
    want = F.softplus(-rows).masked_fill(rows == -MASKED_LOGIT, 0.0).sum(1)
    for dtype, rtol in ((torch.float64, 1e-13), (torch.float32, 1e-5)):
        got = softplus_sum_(rows.to(dtype, copy=True), torch.empty_like(rows, dtype=dtype))
        torch.testing.assert_close(got.double(), want, rtol=rtol, atol=0)
    one = torch.tensor([[5.0, 20.0, -5.0]], dtype=torch.float64)
    torch.testing.assert_close(softplus_sum_(one.clone(), torch.empty_like(one)),
                               F.softplus(-one).sum(1), rtol=1e-15, atol=1e-16)


@pytest.mark.parametrize("tau", [0.2, 0.004], ids=["tau=0.2", "tau=0.004-past-the-floor"])
@pytest.mark.parametrize("tile_size", [None, 5], ids=["dense", "tiled"])
@pytest.mark.parametrize("name,eps", [("sincere", {}), ("eps_supinfonce", {"eps": 0.3})])
def test_sincere_at_any_temperature_equals_its_plain_form(name, eps, tile_size, tau):
    """At tau = 0.004 the logits span +-250, so lse_i - l_ip runs past 80, where the terms
    are linear: value and gradient in float64 equal the plain form's."""
    b = make_multiview_batch(3)
    ours, metrics = batch_loss(name, b.z, b.ids, b.labels, temperature=tau,
                               tile_size=tile_size, **eps)
    reference = objective_spec(name).plain(BatchRows(b.z, b.ids, b.labels), tau, **eps)
    if tau < 0.01:
        x = _largest_pair_argument(b, tau)
        assert x > -FLOOR, f"the batch puts no pair past the floor ({x:.1f})"
    torch.testing.assert_close(ours, reference, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(b.grad_of(ours), b.grad_of(reference), rtol=1e-10, atol=1e-12)
    assert torch.isfinite(torch.as_tensor(metrics["infonce"]))


def _largest_pair_argument(b, tau: float) -> float:
    """max over positive pairs of lse_i(negatives) - l_ip, label positives."""
    z = F.normalize(b.z.detach(), dim=1)
    logits = z @ z.T / tau
    same = b.labels[:, None] == b.labels[None, :]
    own = torch.eye(len(z), dtype=torch.bool)
    lse = logits.masked_fill(same, float("-inf")).logsumexp(1)
    x = (lse[:, None] - logits).masked_fill(~same | own, float("-inf"))
    return x.max().item()
