"""SimCLR views of a whole batch at once, equal bit for bit to :func:`simclr_view` per image.

On small images the per-call cost of torchvision's transforms dominates: a 32 px SimCLR
view takes about 1.6 ms on one core, half of it in the hue jitter (an RGB -> HSV -> RGB
round trip of some 40 tensor operations on a 3 x 32 x 32 image). Here each view first
draws all its random parameters through the very same torchvision transforms (so the
random stream, and with it every view, is unchanged), crops and flips at once, and leaves
the colour operations for later; the batch then applies them, each view's steps in its own
order, with the hue step of all views done as one tensor operation (each view's steps
before its hue step first, those after it next). Only the cheap steps (brightness,
contrast, saturation, grayscale, blur) stay per view.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torchvision.transforms.v2 import functional as F
from torchvision.transforms.v2.functional._color import _hsv_to_rgb, _rgb_to_hsv

from data_pipeline.transforms import (
    MEAN,
    STD,
    SeparableGaussianBlur,
    gaussian_blur,
    simclr_view,
    view_transform,
)

BRIGHTNESS, CONTRAST, SATURATION, HUE = range(4)  # torchvision's ColorJitter fn_idx
# pixels per batched hue step: ~64 images of 32 x 32, one of 224 x 224 (whose float
# temporaries would otherwise leave the cache and cost more than the calls saved)
HUE_CHUNK_PIXELS = 2**16


@dataclass
class DrawnView:
    """A cropped, flipped view [3, R, R] uint8 and the colour steps still to apply."""

    image: Tensor
    jitter: dict[str, Any] | None = None  # ColorJitter's params when it applies
    grayscale: bool = False
    blur_sigma: float | None = None


class _Deferred:
    """Mixed into a torchvision transform: ``make_params`` (and so the random draws) stays
    the transform's own; ``transform`` records the params instead of applying them."""

    recorded: dict[str, Any] | None = None

    def transform(self, inpt: Any, params: dict[str, Any]) -> Any:
        self.recorded = params
        return inpt


def recording(transform: Any) -> Any:
    """``transform`` (a torchvision transform object), made to record its params in
    ``.recorded`` instead of applying them: its random draws stay its own."""
    transform.__class__ = type(f"Deferred{type(transform).__name__}",
                               (_Deferred, type(transform)), {})
    return transform


@dataclass
class RecordedSteps:
    """``simclr_view``'s own transform objects (one source of truth for the recipe) without
    its normalisation: ``steps`` in order, the colour ones (``jitter``, ``gray``, ``blur``)
    turned into recorders."""

    steps: list[Any]
    jitter: Any
    gray: Any
    blur: Any

    @classmethod
    def of(cls, *recipe: Any) -> RecordedSteps:
        """``recipe``: :func:`simclr_view`'s arguments."""
        crop, flip_step, jitter_apply, gray, blur_apply = simclr_view(*recipe).transforms[:5]
        assert isinstance(blur_apply.transforms[0], SeparableGaussianBlur)
        return cls([crop, flip_step, jitter_apply, recording(gray), blur_apply],
                   recording(jitter_apply.transforms[0]), gray,
                   recording(blur_apply.transforms[0]))

    def start(self) -> None:
        """Forget the last view's records (also of steps made recorders later)."""
        for step in (*self.steps, self.jitter, self.blur):
            if isinstance(step, _Deferred):
                step.recorded = None


class SimCLRViews:
    """``draw(image)`` per view under the view's seed, then ``render(views)`` once per batch
    -> [N, 3, R, R] float32, normalised; equal to ``simclr_view(...)(image)`` per view."""

    rowwise = True  # each row of a render depends on its own view alone

    def __init__(self, resolution: int, min_scale: float = 0.08, color_strength: float = 0.5,
                 grayscale: float = 0.2, blur: float = 0.5, flip: float = 0.5,
                 hue: float | None = None) -> None:
        self.recorded = RecordedSteps.of(resolution, min_scale, color_strength, grayscale,
                                         blur, flip, hue)
        self.kernel_size = self.recorded.blur.kernel_size

    def draw(self, image: Tensor) -> DrawnView:
        """Consumes the random stream exactly as ``simclr_view`` does for ``image``."""
        rec = self.recorded
        rec.start()
        for step in rec.steps:
            image = step(image)
        return DrawnView(image, rec.jitter.recorded, rec.gray.recorded is not None,
                         None if rec.blur.recorded is None else rec.blur.recorded["sigma"])

    def render(self, views: list[DrawnView]) -> Tensor:
        images = [v.image for v in views]
        after: list[list[int]] = []  # each view's jitter steps after its hue step
        for i, view in enumerate(views):
            before, rest = _jitter_order(view.jitter)
            for step in before:
                images[i] = _blend_step(images[i], step, view.jitter)
            after.append(rest)
        # the hue step of every view at once, whatever its place in the view's order
        hue_rows = [i for i, v in enumerate(views) if v.jitter and v.jitter["hue_factor"]
                    is not None]
        rows = max(1, HUE_CHUNK_PIXELS // images[0][0].numel()) if views else 1
        for start in range(0, len(hue_rows), rows):  # chunks that stay in cache
            chunk = hue_rows[start:start + rows]
            factors = torch.tensor([views[i].jitter["hue_factor"] for i in chunk])
            shifted = adjust_hue(torch.stack([images[i] for i in chunk]), factors)
            for i, image in zip(chunk, shifted, strict=True):
                images[i] = image
        for i, view in enumerate(views):
            for step in after[i]:
                images[i] = _blend_step(images[i], step, view.jitter)
            if view.grayscale:
                images[i] = F.rgb_to_grayscale(images[i], num_output_channels=3)
            if view.blur_sigma is not None:
                images[i] = gaussian_blur(images[i], self.kernel_size, view.blur_sigma)
        out = F.to_dtype(torch.stack(images), torch.float32, scale=True)
        return F.normalize(out, MEAN, STD)


class PerView:
    """Any per-image transform in the same two steps: ``draw`` applies it, ``render``
    stacks."""

    rowwise = True

    def __init__(self, transform: Any) -> None:
        self.transform = transform

    def draw(self, image: Tensor) -> Tensor:
        return self.transform(image)

    def render(self, views: list[Tensor]) -> Tensor:
        return torch.stack(views)


def batch_views(kind: str, resolution: int, min_scale: float, color_strength: float = 0.5,
                grayscale: float = 0.2, blur: float = 0.5, flip: float = 0.5,
                hue: float | None = None) -> SimCLRViews | PerView:
    """The views of ``view_transform(kind, ...)``, batched where that pays (SimCLR's)."""
    if kind == "simclr":
        return SimCLRViews(resolution, min_scale, color_strength, grayscale, blur, flip, hue)
    return PerView(view_transform(kind, resolution, min_scale, color_strength, grayscale,
                                  blur, flip, hue))


def _jitter_order(jitter: dict[str, Any] | None) -> tuple[list[int], list[int]]:
    """A view's brightness, contrast and saturation steps (ColorJitter's ``fn_idx`` order)
    before its hue step and after it; all of them before when it has no hue step."""
    if jitter is None:
        return [], []
    order = [int(step) for step in jitter["fn_idx"]]
    if jitter["hue_factor"] is None:
        return [step for step in order if step != HUE], []
    cut = order.index(HUE)
    return order[:cut], order[cut + 1:]


def _blend_step(image: Tensor, step: int, params: dict[str, Any]) -> Tensor:
    if step == BRIGHTNESS and params["brightness_factor"] is not None:
        return F.adjust_brightness(image, params["brightness_factor"])
    if step == CONTRAST and params["contrast_factor"] is not None:
        return F.adjust_contrast(image, params["contrast_factor"])
    if step == SATURATION and params["saturation_factor"] is not None:
        return F.adjust_saturation(image, params["saturation_factor"])
    return image


def adjust_hue(images: Tensor, factors: Tensor) -> Tensor:
    """torchvision's ``adjust_hue`` on [N, 3, H, W] uint8 with one factor per image [N]:
    the same operations (its own HSV conversions), so each row equals the single call."""
    hsv = _rgb_to_hsv(F.to_dtype(images, torch.float32, scale=True))
    h, s, v = hsv.unbind(dim=-3)
    h.add_(factors.to(h.dtype).view(-1, 1, 1)).remainder_(1.0)
    rgb = _hsv_to_rgb(torch.stack((h, s, v), dim=-3))
    return F.to_dtype(rgb, images.dtype, scale=True)
