"""The colour steps of SimCLR views for a whole batch on its device, one factor per view.

The same arithmetic as torchvision's uint8 kernels (``adjust_brightness``,
``adjust_contrast``, ``adjust_saturation``, ``adjust_hue``, ``rgb_to_grayscale``) and
:func:`data_pipeline.transforms.gaussian_blur`, with each factor a per-view tensor instead
of a Python number, so a view rendered here equals ``simclr_view`` applied to the same
crop (tests compare them). Each step runs on the views that take it at that point of their
jitter order, gathered into one batch: the view parameters stay on the host, so choosing
the rows never waits for the device, every step's rows and values reach it in one pinned,
non-blocking copy, and the expensive hue step runs once per view that jitters rather than
once per view and position.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor
from torchvision.transforms.v2 import functional as F
from torchvision.transforms.v2.functional._color import _rgb_to_grayscale_image

from data_pipeline.transforms import MEAN, STD
from data_pipeline.views import BRIGHTNESS, CONTRAST, HUE, SATURATION, adjust_hue


def _ratio(factors: Tensor) -> tuple[Tensor, Tensor]:
    """(r, 1 - r) as [N, 1, 1, 1] float32, each rounded from float64 as torchvision's
    Python-number factors are."""
    shape = (-1, 1, 1, 1)
    return factors.to(torch.float32).view(shape), (1.0 - factors).to(torch.float32).view(shape)


def _blend(images: Tensor, other: Tensor, factors: Tensor) -> Tensor:
    ratio, rest = _ratio(factors)
    return images.mul(ratio).addcmul_(other, rest).clamp_(0, 255).to(torch.uint8)


def adjust_brightness(images: Tensor, factors: Tensor) -> Tensor:
    return images.mul(_ratio(factors)[0]).clamp_(0, 255).to(torch.uint8)


def _gray(images: Tensor) -> Tensor:
    """[N, 1, H, W] float32 luma, floored as torchvision does for uint8."""
    return _rgb_to_grayscale_image(images, num_output_channels=1, preserve_dtype=False).floor_()


def adjust_contrast(images: Tensor, factors: Tensor) -> Tensor:
    return _blend(images, _gray(images).mean(dim=(-3, -2, -1), keepdim=True), factors)


def adjust_saturation(images: Tensor, factors: Tensor) -> Tensor:
    return _blend(images, _gray(images), factors)


STEPS = {BRIGHTNESS: adjust_brightness, CONTRAST: adjust_contrast,
         SATURATION: adjust_saturation, HUE: adjust_hue}


def blur(images: Tensor, kernel_size: int, sigmas: Tensor) -> Tensor:
    """:func:`gaussian_blur` of each [3, H, W] uint8 view with its own sigma [N] (> 0)."""
    n, channels = images.shape[:2]
    half = kernel_size // 2
    x = torch.linspace(-half, half, kernel_size, device=images.device)
    kernels = torch.exp(-0.5 * (x / sigmas.to(torch.float32)[:, None]) ** 2)  # [N, K]
    kernels = (kernels / kernels.sum(dim=1, keepdim=True)).repeat_interleave(channels, 0)
    out = images.to(torch.float32).reshape(1, n * channels, *images.shape[2:])
    out = torch.nn.functional.pad(out, (half, half, half, half), mode="reflect")
    out = torch.nn.functional.conv2d(out, kernels.view(-1, 1, 1, kernel_size),
                                     groups=n * channels)
    out = torch.nn.functional.conv2d(out, kernels.view(-1, 1, kernel_size, 1),
                                     groups=n * channels)
    return out.view_as(images).round_().clamp_(0, 255).to(torch.uint8)


Step = Callable[[Tensor, Tensor | None], Tensor]  # (views, their values or None) -> views


class ColourPlan(NamedTuple):
    """The colour steps a batch takes, in order: each step, the rows [n] that take it and
    their values [n] (None: the step has none), on the host."""

    steps: list[Step]
    host: list[Tensor]  # per step: its rows, then its values if it has any
    has_values: list[bool]


def colour_plan(params: dict[str, Tensor], kernel_size: int) -> ColourPlan:
    """The host tensors ``view_params`` (:class:`SimCLRParams`) -> the steps that
    :func:`apply_colour` runs: flip, the colour jitter in each view's order, grayscale,
    blur, as ``simclr_view`` (flip commutes with the rest), each on the views that take it
    only, chosen here on the host."""
    factors, order, sigmas = params["factors"], params["order"], params["sigma"]
    candidates: list[tuple[Step, Tensor, Tensor | None]] = [
        (lambda views, _: views.flip(-1), params["flip"], None)]
    for position in range(4):
        for step in STEPS:
            take = (order[:, position] == step) & ~factors[:, step].isnan()
            candidates.append((STEPS[step], take, factors[:, step]))
    candidates.append((lambda views, _: F.rgb_to_grayscale(views, num_output_channels=3),
                       params["grayscale"], None))
    candidates.append((lambda views, sigma: blur(views, kernel_size, sigma), ~sigmas.isnan(),
                       sigmas))
    plan = ColourPlan([], [], [])
    for step, take, values in candidates:
        if take.any():
            rows = take.nonzero().squeeze(1)
            plan.steps.append(step)
            plan.host.extend([rows] if values is None else [rows, values[rows]])
            plan.has_values.append(values is not None)
    return plan


def apply_colour(crops: Tensor, plan: ColourPlan, moved: list[Tensor] | None = None) -> Tensor:
    """[N, 3, R, R] uint8 crops on their device -> the views [N, 3, R, R] float32,
    normalised, by the plan's steps; ``moved``: ``plan.host`` already on the crops' device
    (copied with other tensors), else copied here in one copy (:func:`on_device`)."""
    moved = iter(on_device(plan.host, crops.device) if moved is None else moved)
    images = crops.clone()
    for step, has_values in zip(plan.steps, plan.has_values, strict=True):
        index = next(moved)
        values = next(moved) if has_values else None
        images.index_copy_(0, index, step(images.index_select(0, index), values))
    return F.normalize(F.to_dtype(images, torch.float32, scale=True), MEAN, STD)


def on_device(host: list[Tensor], device: torch.device) -> list[Tensor]:
    """Host tensors (int64 rows, float32 or float64 values, any shape) on ``device`` in one
    copy: joined as float64 (exact for each of them), on CUDA pinned and copied without
    waiting, then split, shaped and cast back there."""
    if not host:
        return []
    joined = torch.cat([part.reshape(-1).to(torch.float64) for part in host])
    if device.type == "cuda":
        joined = joined.pin_memory().to(device, non_blocking=True)
    parts = joined.split([part.numel() for part in host])
    return [moved.view(part.shape).to(part.dtype)
            for moved, part in zip(parts, host, strict=True)]
