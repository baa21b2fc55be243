"""What the plain forms of the table (``test_plain_forms.py``) do not reach, in float64 on
batches with repeated labels, anchors without positives, D = 7: the identities FlatNCE and
Hoelder-FlatNCE are defined by, against per-anchor loops (``naive.py``); settings beyond
the entries' examples (per-view captions, every kernel metric, the learned table's and a
learnable temperature's gradients) against the plain forms; the metrics' values."""

from __future__ import annotations

import pytest
import torch

from pretrain.objectives import BatchRows, batch_loss
from pretrain.objectives.table import OBJECTIVES
from tests.pretrain.objectives import naive

TAU = 0.3


def plain(name: str, batch, tau, captions=None, **keys):
    """The table's plain form of ``name`` on the batch's rows."""
    rows = BatchRows(batch.z, batch.ids, batch.labels, captions, batch.text)
    return OBJECTIVES[name].plain(rows, tau, **keys)


def assert_same(batch, loss, reference) -> None:
    torch.testing.assert_close(loss, reference, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(batch.grad_of(loss), batch.grad_of(reference),
                               rtol=1e-9, atol=1e-12)


def test_flatnce_value_is_zero_and_gradient_is_infonce_without_positive(batch):
    loss, metrics = batch_loss("flatnce", batch.z, batch.ids, temperature=TAU)
    assert loss.item() == 0.0
    reference = naive.infonce_without_positive(batch.z, batch.ids, TAU)
    torch.testing.assert_close(batch.grad_of(loss), batch.grad_of(reference),
                               rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(metrics["loss"], naive.supcon(batch.z, batch.ids, TAU).detach())


@pytest.mark.parametrize("gamma", [0.5, 2.0, 3.0])
def test_holder_flatnce_is_flatnce_on_scaled_logits_and_paper_form(batch, gamma):
    loss, _ = batch_loss("holder_flatnce", batch.z, batch.ids, temperature=TAU, gamma=gamma)
    flat_scaled, _ = batch_loss("flatnce", batch.z, batch.ids, temperature=TAU / gamma)
    grad = batch.grad_of(loss)
    torch.testing.assert_close(grad, batch.grad_of(flat_scaled), rtol=1e-9, atol=1e-12)
    # The paper's m_gamma / detach(m_gamma) form has exactly 1/gamma of that gradient.
    paper = naive.holder_mean_flatnce(batch.z, batch.ids, TAU, gamma)
    torch.testing.assert_close(grad / gamma, batch.grad_of(paper), rtol=1e-9, atol=1e-12)


def test_xclr_with_a_different_caption_per_view(batch):
    captions = torch.randn(len(batch.ids), 5, dtype=torch.float64)
    captions[3] = captions[7]  # and one caption shared by unrelated rows
    loss, _ = batch_loss("xclr", batch.z, batch.ids, captions=captions, temperature=TAU)
    assert_same(batch, loss, plain("xclr", batch, TAU, captions=captions,
                                   target_temperature=0.1))


def test_xclr_on_a_subset_of_negatives(batch):
    from tests.pretrain.objectives.batches import batch_of

    subset = batch_of(batch.z, batch.ids, num_negatives=4, negatives_seed=2)
    kept = subset.positive_mask("instance") | subset.negative_mask("instance")
    loss, _ = batch_loss("xclr", batch.z, batch.ids, captions=batch.captions, temperature=TAU,
                         num_negatives=4, negatives_seed=2)
    caps = naive.unit(batch.captions)
    reference = naive.xclr(batch.z, caps @ caps.T, TAU, 0.1,
                           columns_kept=lambda i, j: bool(kept[i, j]))
    assert_same(batch, loss, reference)


def test_xclr_targets_follow_the_embeddings_precision():
    z = torch.randn(12, 5)
    ids = torch.arange(6).repeat(2)
    labels = ids % 3
    graph64 = torch.eye(3, dtype=torch.float64)
    loss64, _ = batch_loss("xclr", z, ids, labels, class_graph=graph64, temperature=0.1)
    loss32, _ = batch_loss("xclr", z, ids, labels, class_graph=graph64.float(), temperature=0.1)
    assert loss64.dtype == torch.float32
    torch.testing.assert_close(loss64, loss32)
    captions = torch.randn(6, 4, dtype=torch.float64)[ids]
    assert batch_loss("xclr", z, ids, captions=captions, temperature=0.1)[0].dtype == torch.float32


def test_projnce_centroid_reports_the_mean_adjustment(batch):
    loss, metrics = batch_loss("projnce", batch.z, batch.ids, batch.labels, temperature=TAU)
    plus, minus = naive.centroid_projections(batch.z, batch.labels)
    _, adjustment = naive.projnce(batch.z, batch.labels, TAU, plus, minus)
    torch.testing.assert_close(metrics["adjustment"], adjustment.detach())


@pytest.mark.parametrize(("metric", "bandwidth"), [("l1", 2.0), ("l2", 1.2), ("cos", 0.6)])
def test_projnce_kernel(batch, metric, bandwidth):
    loss, _ = batch_loss("projnce", batch.z, batch.ids, batch.labels, temperature=TAU,
                         projection="kernel", bandwidth=bandwidth, kernel_metric=metric)
    assert_same(batch, loss, plain("projnce", batch, TAU, projection="kernel",
                                   bandwidth=bandwidth, kernel_metric=metric, neighbours=64))


@pytest.mark.parametrize(("metric", "bandwidth"), [("l1", 3.5), ("l2", 1.6), ("cos", 0.9)])
def test_projnce_kernel_weighs_the_nearest_neighbours(batch, metric, bandwidth):
    """With k = 3 of 18 others, most samples have more than k within the bandwidth: each
    weighs its 3 most similar, the loss moves, and kernel_truncated counts those samples
    (whose 4th most similar other lies inside the cosine ball of the bandwidth)."""
    kernel = {"projection": "kernel", "bandwidth": bandwidth, "kernel_metric": metric}
    loss, metrics = batch_loss("projnce", batch.z, batch.ids, batch.labels, temperature=TAU,
                               neighbours=3, **kernel)
    assert_same(batch, loss, plain("projnce", batch, TAU, neighbours=3, **kernel))
    every, every_metrics = batch_loss("projnce", batch.z, batch.ids, batch.labels,
                                      temperature=TAU, neighbours=18, **kernel)
    assert abs(every.item() - loss.item()) > 1e-3
    assert every_metrics["kernel_truncated"].item() == 0.0
    z = naive.unit(batch.z.detach())
    similarity = (z @ z.T).fill_diagonal_(float("-inf"))
    ball = 1 - 2 * bandwidth if metric == "cos" else 1 - bandwidth**2 / 2
    fourth = similarity.sort(dim=1, descending=True).values[:, 3]
    assert 0.5 < metrics["kernel_truncated"].item() == (fourth > ball).double().mean().item()


def test_projnce_kernel_support_is_neither_empty_nor_full(batch):
    """The bandwidths above give some, but not all, pairs kernel weight."""
    z = naive.unit(batch.z.detach())
    l1 = torch.cdist(z, z, p=1)
    inside = (l1 < 2.0).sum() - len(z)
    assert 0 < inside < len(z) * (len(z) - 1)


def test_projnce_learned_gradients_reach_class_embeddings(batch):
    table = torch.randn(6, batch.z.shape[1], dtype=torch.float64).requires_grad_()
    loss, _ = batch_loss("projnce", batch.z, batch.ids, batch.labels, temperature=TAU,
                         projection="learned", class_embeddings=table)
    reference = plain("projnce", batch, TAU, projection="learned", class_embeddings=table,
                      bandwidth=0.5, kernel_metric="l1", neighbours=64)
    torch.testing.assert_close(loss, reference, rtol=1e-10, atol=1e-12)
    for got, want in zip(torch.autograd.grad(loss, [batch.z, table]),
                         torch.autograd.grad(reference, [batch.z, table]), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


def test_learnable_temperature_gradient_matches_the_plain_form(batch):
    tau = torch.tensor(TAU, dtype=torch.float64, requires_grad=True)
    loss, _ = batch_loss("supcon", batch.z, batch.ids, batch.labels, temperature=tau)
    reference = plain("supcon", batch, tau)
    torch.testing.assert_close(torch.autograd.grad(loss, tau)[0],
                               torch.autograd.grad(reference, tau)[0])


@pytest.mark.parametrize("source", ["captions", "class_graph", "per_view"])
def test_xclr_target_entropy_matches_dense_targets(batch, source):
    """metrics["target_entropy"] = mean_i -sum_j t_ij log t_ij of the dense targets."""
    gen = torch.Generator().manual_seed(5)
    names = naive.unit(torch.randn(6, 5, generator=gen, dtype=torch.float64))
    captions = {"captions": batch.captions, "per_view": torch.randn(19, 4, generator=gen,
                                                                   dtype=torch.float64)}
    if source == "class_graph":
        graph = names @ names.T
        kwargs, sim = {"class_graph": graph}, graph[batch.labels][:, batch.labels]
    else:
        caps = naive.unit(captions[source])
        kwargs, sim = {"captions": captions[source]}, caps @ caps.T
    _, metrics = batch_loss("xclr", batch.z, batch.ids, batch.labels, temperature=TAU,
                            target_temperature=0.2, **kwargs)
    logits = (sim / 0.2).masked_fill(torch.eye(len(sim), dtype=torch.bool), float("-inf"))
    targets = torch.softmax(logits, dim=1)
    entropy = -(targets * torch.log(targets.clamp(min=1e-300))).sum(1).mean()
    torch.testing.assert_close(metrics["target_entropy"], entropy)
