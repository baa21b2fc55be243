"""Image decoding and the view transforms (SimCLR augmentation set, AutoAugment, eval)."""

from __future__ import annotations

import io

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from torch import Tensor
from torchvision.transforms import v2

from data_pipeline.sources import SkipSample

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def decode(data: bytes, where: str) -> Tensor:
    """[3, H, W] uint8 from encoded bytes; SkipSample('corrupt_image') when undecodable."""
    try:
        with Image.open(io.BytesIO(data)) as image:
            pixels = np.asarray(image.convert("RGB"))
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as err:
        raise SkipSample("corrupt_image", f"{where}: {err}") from None
    return torch.from_numpy(pixels.copy()).permute(2, 0, 1)


def _finish() -> list[v2.Transform]:
    return [v2.ToDtype(torch.float32, scale=True), v2.Normalize(MEAN, STD)]


def simclr_view(resolution: int, min_scale: float = 0.08) -> v2.Compose:
    """SimCLR (Chen et al. 2020, appendix A): crop, flip, colour jitter, grayscale, blur."""
    kernel = max(3, (resolution // 10) | 1)  # odd, ~10% of the image as in SimCLR
    return v2.Compose([
        v2.RandomResizedCrop(resolution, scale=(min_scale, 1.0), antialias=True),
        v2.RandomHorizontalFlip(),
        v2.RandomApply([v2.ColorJitter(0.4, 0.4, 0.4, 0.1)], p=0.8),
        v2.RandomGrayscale(p=0.2),
        v2.RandomApply([v2.GaussianBlur(kernel, sigma=(0.1, 2.0))], p=0.5),
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


def view_transform(kind: str, resolution: int, min_scale: float) -> v2.Compose:
    if kind == "simclr":
        return simclr_view(resolution, min_scale)
    if kind == "autoaugment":
        return autoaugment_view(resolution, min_scale)
    return eval_view(resolution)
