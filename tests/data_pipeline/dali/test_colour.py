"""The DALI backend's worker-side draws and device-side colour steps equal torchvision's
SimCLR views: same seeds give the same crop boxes, flips and colour factors, and the batched
colour steps reproduce ``simclr_view`` applied one view at a time, and run on a CUDA device
from one copy of their parameters."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from torchvision.transforms.v2 import functional as TF

from data_pipeline.dali.colour import apply_colour, blur, colour_plan, on_device
from data_pipeline.dali.params import EncodedImage, SimCLRParams
from data_pipeline.transforms import gaussian_blur, simclr_view, view_kernel_size
from tests.cuda_dry_run import fake_cuda
from tests.data_pipeline.test_views import RECIPES, images, per_view


def drawn_params(recipe: dict, pictures: list[torch.Tensor], seeds: list[int]) -> list:
    draw = SimCLRParams(**recipe)
    views = []
    for picture, seed in zip(pictures, seeds, strict=True):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            views.append(draw.draw(EncodedImage(b"", *picture.shape[1:], ("shard", "key"))))
    return draw, views


@pytest.mark.parametrize("recipe", RECIPES)
def test_parameters_and_batched_colour_equal_simclr_view(recipe):
    """Each view: torchvision's crop of the drawn box, then the batched colour steps ==
    ``simclr_view`` under the view's seed, bit for bit (on the CPU; a GPU may round the
    float32 blends differently)."""
    pictures, seeds = images(120), list(range(100, 220))
    draw, views = drawn_params(recipe, pictures, seeds)
    rendered = draw.render(views + views)["view_params"]
    half = {name: value[:120] for name, value in rendered.items()}
    crops = torch.stack([TF.resized_crop(p, *v.box, [recipe["resolution"]] * 2, antialias=True)
                         for p, v in zip(pictures, views, strict=True)])
    got = apply_colour(crops, colour_plan(half, view_kernel_size(recipe["resolution"])))
    assert torch.equal(got, per_view(simclr_view(**recipe), pictures, seeds))
    assert sum(v.factors[0] == v.factors[0] for v in views) > 60  # jitter drawn (p = 0.8)


def test_drawn_parameters_cover_every_step():
    recipe = RECIPES[2]  # grayscale, blur and flip with p = 1
    _, views = drawn_params(recipe, images(40), list(range(40)))
    assert all(v.flip and v.grayscale and 0.1 <= v.sigma <= 2.0 for v in views)
    orders = {tuple(v.order) for v in views}
    assert len(orders) > 5 and all(sorted(o) == [0, 1, 2, 3] for o in orders)


def test_blur_with_a_sigma_per_view_equals_one_call_per_view():
    pictures = torch.stack([p[:, :, :36] for p in images(8, seed=3)])
    sigmas = torch.linspace(0.1, 2.0, 8, dtype=torch.float64)
    want = torch.stack([gaussian_blur(p, 5, float(s)) for p, s in zip(pictures, sigmas,
                                                                        strict=True)])
    assert (blur(pictures, 5, sigmas).int() - want.int()).abs().max() <= 1


def test_the_colour_steps_run_on_a_cuda_device_from_one_copy_of_their_parameters():
    """The device logic on the CPU (fake CUDA tensors, ``tests/cuda_dry_run.py``): with the
    plan made on the host, the steps read no value back on the host, mix no host tensor
    with the views, and take every step's rows and values over in one pinned copy."""
    recipe = RECIPES[2]  # every step taken
    draw, views = drawn_params(recipe, images(8), list(range(8)))
    params = {name: value[:8] for name, value in draw.render(views + views)["view_params"].items()}
    plan = colour_plan(params, view_kernel_size(recipe["resolution"]))
    assert len(plan.steps) >= 4
    pinned = []
    with fake_cuda(value_dependent_shapes=False), mock.patch.object(
            torch.Tensor, "pin_memory", lambda self: pinned.append(self.shape) or self):
        crops = torch.zeros(8, 3, 24, 24, dtype=torch.uint8, device="cuda")
        out = apply_colour(crops, plan)
    assert out.shape == (8, 3, 24, 24) and out.device.type == "cuda"
    assert pinned == [(sum(len(part) for part in plan.host),)]


def test_rows_and_values_come_back_from_their_joined_copy_exactly():
    rows = torch.tensor([0, 5, 2**40], dtype=torch.int64)
    values = torch.tensor([0.1, -2.5e-300], dtype=torch.float64)
    got = on_device([rows, values], torch.device("cpu"))
    assert [t.dtype for t in got] == [torch.int64, torch.float64]
    assert torch.equal(got[0], rows) and torch.equal(got[1], values)
