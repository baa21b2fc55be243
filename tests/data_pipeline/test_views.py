"""Batched SimCLR views equal torchvision's transforms applied one view at a time, bit for
bit, and the collator's batches equal the per-view reference."""

from __future__ import annotations

import pytest
import torch
from torchvision.transforms.v2 import functional as TF

from data_pipeline.config import DataConfig
from data_pipeline.loader.collate import PieceDrawer
from data_pipeline.samples import RawSample, SkipLog
from data_pipeline.transforms import simclr_view, view_transform
from data_pipeline.views import SimCLRViews, adjust_hue

RECIPES = [
    {"resolution": 32, "min_scale": 0.3, "color_strength": 1.0, "grayscale": 0.5,
     "blur": 0.0, "flip": 0.0, "hue": 0.5},  # the cluttered digits' self-supervised views
    {"resolution": 32, "min_scale": 0.5, "color_strength": 0.5, "grayscale": 0.2,
     "blur": 0.5, "flip": 0.5},  # SimCLR's CIFAR views
    {"resolution": 24, "min_scale": 0.08, "color_strength": 1.0, "grayscale": 1.0,
     "blur": 1.0, "flip": 1.0},
]


def images(count: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (3, 40, 36 + i % 9), generator=gen, dtype=torch.uint8)
            for i in range(count)]


def per_view(transform, pictures: list[torch.Tensor], seeds: list[int]) -> torch.Tensor:
    views = []
    for picture, seed in zip(pictures, seeds, strict=True):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            views.append(transform(picture))
    return torch.stack(views)


@pytest.mark.parametrize("recipe", RECIPES)
def test_batched_views_equal_torchvision_per_view(recipe):
    pictures, seeds = images(120), list(range(100, 220))
    views = SimCLRViews(**recipe)
    drawn = []
    for picture, seed in zip(pictures, seeds, strict=True):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            drawn.append(views.draw(picture))
    assert torch.equal(views.render(drawn), per_view(simclr_view(**recipe), pictures, seeds))
    assert sum(v.jitter is not None for v in drawn) > 60  # colour jitter drawn (p = 0.8)


def test_hue_of_a_batch_equals_one_call_per_image():
    pictures = torch.stack([p[:, :, :36] for p in images(16, seed=1)])
    factors = torch.linspace(-0.5, 0.5, 16)
    want = torch.stack([TF.adjust_hue(p, float(f)) for p, f in zip(pictures, factors,
                                                                    strict=True)])
    assert torch.equal(adjust_hue(pictures, factors), want)


@pytest.mark.parametrize("kw", [{"color_strength": 1.0, "hue": 0.5, "grayscale": 0.5},
                                {"grayscale": 0.0, "grayscale_second": 1.0},
                                {"augment": "autoaugment"}])
def test_collated_batches_equal_the_per_view_reference(kw):
    cfg = DataConfig(resolution=16, crop_min_scale=0.3, **kw)
    pictures, seeds = images(10, seed=2), list(range(10))
    torch.manual_seed(7)
    rendered = PieceDrawer(cfg, epoch=0).render(pictures, seeds)
    after = torch.rand(1)
    torch.manual_seed(7)
    assert torch.equal(after, torch.rand(1))  # the caller's generator is left alone
    second_gray = cfg.grayscale if cfg.grayscale_second is None else cfg.grayscale_second

    def transform(grayscale: float):
        return view_transform(cfg.augment, 16, 0.3, cfg.color_strength, grayscale, cfg.blur,
                              cfg.flip, cfg.hue)

    first, second = transform(cfg.grayscale), transform(second_gray)

    def both(picture: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return first(picture), second(picture)

    pairs = []
    for picture, seed in zip(pictures, seeds, strict=True):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            pairs.append(both(picture))
    want = torch.stack([a for a, _ in pairs] + [b for _, b in pairs])
    assert torch.equal(rendered, want)


@pytest.mark.parametrize("kw", [{"color_strength": 1.0, "hue": 0.5}, {"hue": 0.0},
                                {"augment": "autoaugment"}, {"pairing": "same_label"}])
def test_the_pieces_of_a_message_render_as_each_alone(kw):
    """A worker renders the pieces of its K batches in one call: each piece's views equal
    its own render (hue 0: views without a hue step), an empty piece has none."""
    cfg = DataConfig(resolution=16, crop_min_scale=0.3, **kw)
    pictures = images(9, seed=3)
    items = [(0, i, (RawSample(f"k{i}", "s", b"", 0, None), picture))
             for i, picture in enumerate(pictures)]
    drawer = PieceDrawer(cfg, epoch=0)
    parts = [items[:4], [], items[4:5], items[5:]]
    pieces = drawer([(b, part, SkipLog()) for b, part in enumerate(parts)])
    assert pieces[1]["views"] is None
    for piece, part in zip(pieces, parts, strict=True):
        if part:
            alone = drawer([(0, part, SkipLog())])[0]["views"]
            assert torch.equal(piece["views"], alone)
            assert len(alone) == len(part) * (1 if cfg.pairing == "same_label" else 2)
