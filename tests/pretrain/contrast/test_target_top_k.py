"""X-CLR's sparse targets at the k-th: within 1e-5 in cosine a candidate is a tie and kept,
beyond it dropped, whether the k-th is found over a row, over label groups or tile by tile,
in float32 as in float64."""

from __future__ import annotations

import pytest
import torch

from pretrain.contrast.columns import MASKED_LOGIT
from pretrain.contrast.target_top_k import dense_floor, group_floor, keep_top_k_
from pretrain.objectives import batch_loss
from pretrain.objectives.xclr import TIE


def test_a_near_tie_is_kept_and_a_near_miss_dropped():
    tau_s = 0.1
    cosines = torch.tensor([[0.9, 0.5, 0.5 - 5e-6, 0.5 - 2e-5, 0.1]], dtype=torch.float64)
    logits = cosines / tau_s
    kept = keep_top_k_(logits.clone(), dense_floor(logits, 2), TIE / tau_s) > MASKED_LOGIT / 2
    assert kept.tolist() == [[True, True, True, False, False]]
    # the same row as groups: 0.5 stands for 3 members, so the 2nd column is reached there
    groups = torch.tensor([[0.9, 0.5, 0.1]], dtype=torch.float64) / tau_s
    members = torch.tensor([[1, 3, 4]])
    assert group_floor(groups, members, 2).item() == pytest.approx(5.0)
    assert group_floor(groups, members, 8).item() == pytest.approx(1.0)
    assert group_floor(groups, members, 9).item() == MASKED_LOGIT  # fewer than k columns


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_dense_and_tiled_keep_the_same_candidates_with_duplicate_captions(dtype):
    """Half the captions are repeats of others (ties at cosine 1 that float32 rounds apart
    by tile): the tiled loss and gradient equal the dense ones."""
    gen = torch.Generator().manual_seed(0)
    n, k = 24, 5
    ids = torch.arange(n // 2).repeat(2)
    distinct = torch.randn(n // 4, 16, generator=gen, dtype=dtype)
    captions = distinct[torch.arange(n // 2) % (n // 4)][ids]
    z = torch.randn(n, 8, generator=gen, dtype=dtype, requires_grad=True)
    losses, grads = [], []
    for tile in (None, 5):
        loss, _ = batch_loss("xclr", z, ids, captions=captions, temperature=0.2,
                             target_temperature=0.1, top_k=k, tile_size=tile)
        losses.append(loss.detach())
        grads.append(torch.autograd.grad(loss, z)[0])
    tolerance = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {}
    torch.testing.assert_close(losses[1], losses[0], **tolerance)
    torch.testing.assert_close(grads[1], grads[0], **tolerance)
