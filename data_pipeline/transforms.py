"""Image decoding and the view transforms (SimCLR augmentation set, AutoAugment, eval)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor
from torchvision.transforms import v2

from data_pipeline.images import PILLOW_MAX_PIXELS, opened_image

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


@dataclass(frozen=True)
class DecodeSize:
    """The least image a view needs, so that a JPEG can be decoded at 1/2, 1/4 or 1/8 of
    its size (Pillow's draft mode, libjpeg's DCT scaling) without any view losing detail.

    ``min_crop_area`` (random-resized-crop views): every crop the view can draw, of at
    least that fraction of the area and aspect ratio in [3/4, 4/3], still spans
    ``resolution`` pixels on each side. Otherwise (the eval view) the short side stays at
    least ``resolution * 8 / 7``, the size it is resized to.
    """

    resolution: int
    min_crop_area: float | None = None

    def least(self, width: int, height: int) -> tuple[int, int]:
        """The smallest (width, height) of this aspect ratio that every view allows."""
        if self.min_crop_area is None:
            scale = self.resolution * 8 / 7 / min(width, height)
        else:  # the smallest crop side is sqrt(area * 3/4) at aspect ratio 3/4
            scale = self.resolution / math.sqrt(self.min_crop_area * 0.75 * width * height)
        scale = min(1.0, scale)
        return math.ceil(width * scale), math.ceil(height * scale)


def decode(data: bytes, where: str, size: DecodeSize | None = None,
           max_pixels: int = PILLOW_MAX_PIXELS) -> Tensor:
    """[3, H, W] uint8 from encoded bytes; SkipSample('corrupt_image') when undecodable or
    larger than ``max_pixels`` (:func:`data_pipeline.samples.opened_image`). With ``size``
    a JPEG is decoded at the largest reduction every view allows."""
    with opened_image(data, where, max_pixels) as image:
        if size is not None and image.format == "JPEG":
            image.draft("RGB", size.least(*image.size))
        pixels = np.array(image if image.mode == "RGB" else image.convert("RGB"))
    return torch.from_numpy(pixels).permute(2, 0, 1)


class SeparableGaussianBlur(v2.Transform):
    """Gaussian blur as two 1-D passes, sigma ~ U(sigma_min, sigma_max) per call.

    The same filter as ``v2.GaussianBlur`` (reflect padding, the same kernel, uint8 in and
    out), which convolves with the full 2-D kernel: k^2 instead of 2k multiply-adds per
    pixel, 12 ms against ~1 ms for a 224 px image at k = 23 on one core.
    """

    def __init__(self, kernel_size: int, sigma: tuple[float, float] = (0.1, 2.0)) -> None:
        super().__init__()
        if kernel_size % 2 == 0:
            raise ValueError(f"kernel_size must be odd, got {kernel_size}")
        self.kernel_size, self.sigma = kernel_size, sigma

    def make_params(self, flat_inputs: list) -> dict:
        return {"sigma": float(torch.empty(1).uniform_(*self.sigma))}

    def transform(self, inpt: Tensor, params: dict) -> Tensor:
        if not isinstance(inpt, Tensor):
            return inpt
        return gaussian_blur(inpt, self.kernel_size, params["sigma"])


def gaussian_blur(image: Tensor, kernel_size: int, sigma: float) -> Tensor:
    """Blur [C, H, W] (uint8 or float) with a separable Gaussian, reflect padding."""
    half = kernel_size // 2
    x = torch.linspace(-half, half, kernel_size)
    kernel = torch.exp(-0.5 * (x / sigma) ** 2)
    kernel = kernel / kernel.sum()
    channels = image.shape[0]
    out = image.to(torch.float32)[None]
    out = torch.nn.functional.pad(out, (half, half, half, half), mode="reflect")
    out = torch.nn.functional.conv2d(out, kernel.view(1, 1, 1, -1).expand(channels, 1, 1, -1),
                                     groups=channels)
    out = torch.nn.functional.conv2d(out, kernel.view(1, 1, -1, 1).expand(channels, 1, -1, 1),
                                     groups=channels)[0]
    if image.dtype == torch.uint8:
        return out.round_().clamp_(0, 255).to(torch.uint8)
    return out.to(image.dtype)


def _finish() -> list[v2.Transform]:
    return [v2.ToDtype(torch.float32, scale=True), v2.Normalize(MEAN, STD)]


def view_kernel_size(resolution: int) -> int:
    """SimCLR's blur kernel: odd, about 10% of the view's side."""
    return max(3, (resolution // 10) | 1)


def simclr_view(resolution: int, min_scale: float = 0.08, color_strength: float = 0.5,
                grayscale: float = 0.2, blur: float = 0.5, flip: float = 0.5,
                hue: float | None = None) -> v2.Compose:
    """SimCLR (Chen et al. 2020, appendix A): crop, horizontal flip with p = ``flip``,
    colour jitter of strength s (brightness, contrast, saturation 0.8 s, hue 0.2 s or
    ``hue``, capped at a full turn 0.5; applied with p = 0.8), grayscale with p =
    ``grayscale``, Gaussian blur with p = ``blur``."""
    kernel = view_kernel_size(resolution)
    s = color_strength
    return v2.Compose([
        v2.RandomResizedCrop(resolution, scale=(min_scale, 1.0), antialias=True),
        v2.RandomHorizontalFlip(p=flip),
        v2.RandomApply([v2.ColorJitter(0.8 * s, 0.8 * s, 0.8 * s,
                                       min(0.5, 0.2 * s if hue is None else hue))], p=0.8),
        v2.RandomGrayscale(p=grayscale),
        v2.RandomApply([SeparableGaussianBlur(kernel, sigma=(0.1, 2.0))], p=blur),
        *_finish(),
    ])


def autoaugment_view(resolution: int, min_scale: float = 0.08) -> v2.Compose:
    """The ImageNet AutoAugment recipe the X-CLR paper trains with."""
    return v2.Compose([
        v2.RandomResizedCrop(resolution, scale=(min_scale, 1.0), antialias=True),
        v2.RandomHorizontalFlip(),
        v2.AutoAugment(v2.AutoAugmentPolicy.IMAGENET),
        *_finish(),
    ])


def eval_view(resolution: int) -> v2.Compose:
    """Resize the short side to 8/7 of the resolution, centre crop (the usual eval view)."""
    return v2.Compose([v2.Resize(resolution * 8 // 7, antialias=True),
                       v2.CenterCrop(resolution), *_finish()])


def decode_size(kind: str, resolution: int, min_scale: float) -> DecodeSize:
    """What the views of ``view_transform(kind, ...)`` need of a decoded image."""
    return DecodeSize(resolution, min_scale if kind in ("simclr", "autoaugment") else None)


def view_transform(kind: str, resolution: int, min_scale: float, color_strength: float = 0.5,
                   grayscale: float = 0.2, blur: float = 0.5, flip: float = 0.5,
                   hue: float | None = None) -> v2.Compose:
    if kind == "simclr":
        return simclr_view(resolution, min_scale, color_strength, grayscale, blur, flip, hue)
    if kind == "autoaugment":
        return autoaugment_view(resolution, min_scale)
    return eval_view(resolution)
