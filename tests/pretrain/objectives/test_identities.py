"""Identities between objectives that docs/objectives.md states."""

from __future__ import annotations

import torch

from pretrain.contrast.batch import Columns
from pretrain.objectives import batch_loss
from pretrain.objectives.flatnce import flat_nce
from pretrain.objectives.supcon import supcon
from tests.pretrain.objectives.batches import batch_of
from tests.pretrain.objectives.conftest import make_multiview_batch

TAU = 0.25


def paired_batch(seed: int = 0):
    """Every anchor has a positive: 10 images x 2 views, 4 classes, unique captions."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.arange(10).repeat_interleave(2)
    labels = torch.tensor([0, 0, 1, 1, 1, 2, 2, 3, 3, 3]).repeat_interleave(2)
    z = torch.randn(20, 9, generator=gen, dtype=torch.float64).requires_grad_()
    return z, ids, labels, gen


def grad(loss, z):
    return torch.autograd.grad(loss, z)[0]


def test_supcon_equals_infonce_when_every_label_is_its_own_instance(batch):
    sup, _ = batch_loss("supcon", batch.z, batch.ids, labels=batch.ids.clone(), temperature=TAU)
    inf, _ = batch_loss("infonce", batch.z, batch.ids, labels=batch.labels, temperature=TAU)
    torch.testing.assert_close(sup, inf)
    torch.testing.assert_close(grad(sup, batch.z), grad(inf, batch.z))


def test_eps_supinfonce_at_zero_is_sincere(batch):
    eps0, _ = batch_loss("eps_supinfonce", batch.z, batch.ids, batch.labels, eps=0.0,
                         temperature=0.1)
    sin, _ = batch_loss("sincere", batch.z, batch.ids, batch.labels, temperature=0.1)
    torch.testing.assert_close(eps0, sin, rtol=0, atol=0)


def test_sincere_is_never_above_supcon():
    for seed in range(20):
        b = make_multiview_batch(seed=seed)
        for tau in (0.05, 0.3, 1.0):
            sin, _ = batch_loss("sincere", b.z, b.ids, b.labels, temperature=tau)
            sup, _ = batch_loss("supcon", b.z, b.ids, b.labels, temperature=tau)
            assert sin <= sup + 1e-12


def test_xclr_with_sharp_targets_and_unique_captions_is_infonce():
    z, ids, labels, gen = paired_batch()
    captions = torch.randn(10, 16, generator=gen, dtype=torch.float64)[ids]
    xclr, _ = batch_loss("xclr", z, ids, captions=captions, temperature=TAU,
                         target_temperature=1e-4)
    inf, _ = batch_loss("infonce", z, ids, temperature=TAU)
    torch.testing.assert_close(xclr, inf, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(grad(xclr, z), grad(inf, z), rtol=1e-9, atol=1e-10)


def test_xclr_with_sharp_targets_and_class_template_captions_is_supcon():
    z, ids, labels, gen = paired_batch()
    templates = torch.randn(4, 16, generator=gen, dtype=torch.float64)
    xclr, _ = batch_loss("xclr", z, ids, captions=templates[labels], temperature=TAU,
                         target_temperature=1e-4)
    sup, _ = batch_loss("supcon", z, ids, labels, temperature=TAU)
    torch.testing.assert_close(xclr, sup, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(grad(xclr, z), grad(sup, z), rtol=1e-9, atol=1e-10)
    # The same through the C x C class graph of those templates.
    unit = torch.nn.functional.normalize(templates, dim=1)
    graph_loss, _ = batch_loss("xclr", z, ids, labels, class_graph=unit @ unit.T,
                               temperature=TAU, target_temperature=1e-4)
    torch.testing.assert_close(graph_loss, sup, rtol=1e-9, atol=1e-10)


def test_flatnce_with_positive_among_negatives_has_infonce_gradient():
    z, ids, _, _ = paired_batch()
    batch = batch_of(z, ids)
    logits = batch.anchors @ batch.candidates.T / TAU
    positives = batch.positive_mask("instance")
    pos_logit = logits[positives]  # exactly one positive per anchor here
    with_positive = Columns(logits.shape[1], drop=~(batch.negative_mask("instance") | positives))
    lse = torch.logsumexp(with_positive.apply(logits, float("-inf")), dim=1)
    flat = flat_nce(pos_logit, lse, torch.ones_like(lse, dtype=torch.bool))
    infonce = supcon(batch_of(z, ids), TAU, kind="instance").loss
    torch.testing.assert_close(grad(flat.mean(), z), grad(infonce, z), rtol=1e-9, atol=1e-12)


def test_projnce_with_equal_projections_has_adjustment_exactly_one(batch):
    table = torch.randn(6, batch.z.shape[1], dtype=torch.float64)
    for projection in ("kernel", "median", "learned"):
        _, metrics = batch_loss("projnce", batch.z, batch.ids, batch.labels,
                                projection=projection, class_embeddings=table, temperature=0.1)
        assert float(metrics["adjustment"]) == 1.0, projection
    _, centroid = batch_loss("projnce", batch.z, batch.ids, batch.labels, temperature=0.1)
    assert float(centroid["adjustment"]) != 1.0


def test_projnce_centroid_alignment_term_is_supcon(batch):
    _, metrics = batch_loss("projnce", batch.z, batch.ids, batch.labels, temperature=TAU)
    sup, _ = batch_loss("supcon", batch.z, batch.ids, batch.labels, temperature=TAU)
    torch.testing.assert_close(metrics["i_proj"], sup.detach())


def test_clip_is_symmetric_in_its_modalities(batch):
    a, _ = batch_loss("clip", batch.z, batch.ids, text=batch.text, temperature=TAU)
    b, _ = batch_loss("clip", batch.text, batch.ids, text=batch.z, temperature=TAU)
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_metrics_are_consistent(batch):
    loss, m = batch_loss("infonce", batch.z, batch.ids, batch.labels, temperature=TAU)
    torch.testing.assert_close(m["infonce"], loss.detach())
    n = len(batch.ids)
    assert 1 / (n - 2) <= float(m["ess"]) <= 1.0
    assert -1.0 <= float(m["neg_sim"]) <= 1.0 and -1.0 <= float(m["pos_sim"]) <= 1.0
    log_columns = torch.log(torch.tensor(n - 1.0, dtype=m["infonce"].dtype))
    torch.testing.assert_close(m["mi_bound"], log_columns - m["infonce"])


def test_ess_is_one_for_equal_negatives_and_falls_as_they_spread():
    ids = torch.arange(6).repeat_interleave(2)
    z = torch.zeros(12, 3, dtype=torch.float64)
    z[:, 0] = 1.0  # all identical: every negative has the same weight
    _, m = batch_loss("infonce", z, ids, temperature=0.1)
    torch.testing.assert_close(m["ess"], torch.tensor(1.0, dtype=torch.float64))
    _, sharp = batch_loss("infonce", torch.randn(12, 3, dtype=torch.float64), ids,
                          temperature=0.05)
    assert float(sharp["ess"]) < 0.9
