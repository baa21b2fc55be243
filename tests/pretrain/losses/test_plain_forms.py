"""The production path of every objective (fused, tiled, without host reads: what a run
trains with) equals the plain form its file opens with, in value and gradient, dense and
over column tiles, in float64. ``test_objectives_vs_naive.py`` holds both to loops over
anchors written from ``docs/objectives.md``."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from pretrain.losses import batch_loss
from pretrain.losses.clip import plain_clip
from pretrain.losses.eps_supinfonce import plain_eps_supinfonce
from pretrain.losses.flatnce import plain_flatnce
from pretrain.losses.holder_flatnce import plain_holder_flatnce
from pretrain.losses.infonce import plain_infonce
from pretrain.losses.projections import (
    plain_kernel_class_means,
    plain_median_class_embeddings,
)
from pretrain.losses.projnce import plain_centroid_projections, plain_projnce
from pretrain.losses.siglip import plain_siglip
from pretrain.losses.sincere import plain_sincere
from pretrain.losses.supcon import plain_supcon
from pretrain.losses.xclr import plain_xclr
from tests.pretrain.losses.conftest import Batch, make_multiview_batch

TAU = 0.2
CLASSES = 6  # the batch's labels lie in [0, 6), every class present
GRAPH = torch.rand(CLASSES, CLASSES, generator=torch.Generator().manual_seed(3),
                   dtype=torch.float64)
TABLE = torch.randn(CLASSES, 7, generator=torch.Generator().manual_seed(4), dtype=torch.float64)


def unit(x: torch.Tensor) -> torch.Tensor:
    return F.normalize(x, dim=1)


def grouped(b: Batch, table: torch.Tensor) -> torch.Tensor:
    """A [C, D] projection handed to every sample by its label: g+(y_k) = g-(y_k)."""
    return plain_projnce(b.z, b.labels, TAU, table[b.labels], table[b.labels])


# name -> (batch_loss keywords, the plain form on the batch)
CASES: dict[str, tuple[Callable[[Batch], dict], Callable[[Batch], torch.Tensor]]] = {
    "infonce": (lambda b: {}, lambda b: plain_infonce(b.z, b.ids, TAU)),
    "supcon": (lambda b: {"labels": b.labels}, lambda b: plain_supcon(b.z, b.labels, TAU)),
    "sincere": (lambda b: {"labels": b.labels}, lambda b: plain_sincere(b.z, b.labels, TAU)),
    "eps_supinfonce": (lambda b: {"labels": b.labels, "eps": 0.3},
                       lambda b: plain_eps_supinfonce(b.z, b.labels, TAU, 0.3)),
    "flatnce": (lambda b: {}, lambda b: plain_flatnce(b.z, b.ids, TAU)),
    "holder_flatnce": (lambda b: {"gamma": 1.5},
                       lambda b: plain_holder_flatnce(b.z, b.ids, TAU, 1.5)),
    "xclr[captions]": (lambda b: {"captions": b.captions, "target_temperature": 0.3},
                       lambda b: plain_xclr(b.z, unit(b.captions) @ unit(b.captions).T, TAU,
                                            0.3)),
    "xclr[class_graph]": (lambda b: {"labels": b.labels, "class_graph": GRAPH,
                                     "target_temperature": 0.3},
                          lambda b: plain_xclr(b.z, GRAPH[b.labels][:, b.labels], TAU, 0.3)),
    "projnce[centroid]": (lambda b: {"labels": b.labels},
                          lambda b: plain_projnce(b.z, b.labels, TAU,
                                                  *plain_centroid_projections(b.z, b.labels))),
    "projnce[kernel]": (
        lambda b: {"labels": b.labels, "projection": "kernel", "bandwidth": 1.5,
                   "num_classes": CLASSES},
        lambda b: grouped(b, plain_kernel_class_means(unit(b.z), b.labels, CLASSES, 1.5,
                                                      "l1"))),
    "projnce[kernel, 3 neighbours]": (
        lambda b: {"labels": b.labels, "projection": "kernel", "bandwidth": 3.0,
                   "neighbours": 3, "num_classes": CLASSES},
        lambda b: grouped(b, plain_kernel_class_means(unit(b.z), b.labels, CLASSES, 3.0,
                                                      "l1", neighbours=3))),
    "projnce[median]": (
        lambda b: {"labels": b.labels, "projection": "median", "num_classes": CLASSES},
        lambda b: grouped(b, plain_median_class_embeddings(unit(b.z), b.labels, CLASSES))),
    "projnce[learned]": (
        lambda b: {"labels": b.labels, "projection": "learned", "class_embeddings": TABLE},
        lambda b: grouped(b, unit(TABLE))),
    "clip": (lambda b: {"text": b.text}, lambda b: plain_clip(b.z, b.text, b.ids, TAU)),
    "siglip": (lambda b: {"text": b.text, "bias": -1.5},
               lambda b: plain_siglip(b.z, b.text, b.ids, TAU, -1.5)),
}


@pytest.mark.parametrize("tile_size", [None, 5], ids=["dense", "tiled"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("seed", [0, 1])
def test_the_production_path_equals_the_plain_form(case, tile_size, seed):
    b = make_multiview_batch(seed)
    keywords, plain = CASES[case]
    name = case.split("[")[0]
    ours, _ = batch_loss(name, b.z, b.ids, temperature=TAU, tile_size=tile_size,
                         **keywords(b))
    reference = plain(b)
    torch.testing.assert_close(ours, reference, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(b.grad_of(ours), b.grad_of(reference), rtol=1e-9, atol=1e-12)
