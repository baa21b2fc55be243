"""The production path of every objective (fused, tiled, without host reads: what a run
trains with) equals the plain form its table entry declares, in value and gradient, dense
and over column tiles, in float64, under every setting the entry lists."""

from __future__ import annotations

import pytest
import torch

from pretrain.objectives import batch_loss
from tests.objective_cases import case_ids, objective_cases
from tests.pretrain.objectives.conftest import make_multiview_batch

TAU = 0.2
CLASSES = 6  # the batch's labels lie in [0, 6), every class present
CASES = objective_cases()


@pytest.mark.parametrize("tile_size", [None, 5], ids=["dense", "tiled"])
@pytest.mark.parametrize("case", CASES, ids=case_ids(CASES))
@pytest.mark.parametrize("seed", [0, 1])
def test_the_production_path_equals_the_plain_form(case, tile_size, seed):
    b = make_multiview_batch(seed)
    rows = case.rows(b.z, b.ids, b.labels, b.captions, b.text)
    keywords = case.keywords(CLASSES, b.z.shape[1], torch.float64)
    ours, _ = batch_loss(case.name, rows.z, rows.ids, rows.labels, captions=rows.captions,
                         text=rows.text, temperature=TAU, tile_size=tile_size, **keywords)
    reference = case.spec.plain(rows, TAU, **keywords)
    torch.testing.assert_close(ours, reference, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(b.grad_of(ours), b.grad_of(reference), rtol=1e-9, atol=1e-12)
