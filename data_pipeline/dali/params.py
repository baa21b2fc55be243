"""Loader workers' half of the DALI backend: each view's random parameters, no pixels.

With ``data.backend=dali`` a worker reads, shuffles and checks samples as on the CPU path
but does not decode them: it reads each image's size from its header and draws every view's
crop box, flip and colour steps through the very transform objects of :func:`simclr_view`
(the recipe has one source of truth, and a view's parameters follow from its seed exactly
as on the CPU path, so resume stays exact). The batch carries the encoded images and these
parameters; the main process decodes and crops on the GPU and applies the colour steps
there (``data_pipeline/dali/device.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from data_pipeline.images import PILLOW_MAX_PIXELS, opened_image
from data_pipeline.views import BRIGHTNESS, CONTRAST, HUE, SATURATION, RecordedSteps, recording

FACTOR_NAMES = {BRIGHTNESS: "brightness_factor", CONTRAST: "contrast_factor",
                SATURATION: "saturation_factor", HUE: "hue_factor"}


@dataclass
class EncodedImage:
    """An image as stored: its bytes and the size its header declares."""

    data: bytes
    height: int
    width: int
    source: tuple[str, str]  # (shard, key)


def encoded_image(data: bytes, shard: str, key: str,
                  max_pixels: int = PILLOW_MAX_PIXELS) -> EncodedImage:
    """The image's header read (not decoded); SkipSample('corrupt_image') when Pillow
    cannot identify it or it has more than ``max_pixels`` pixels. A body that fails to
    decode is caught when the batch is decoded."""
    with opened_image(data, f"{shard}:{key}", max_pixels) as image:
        width, height = image.size
    return EncodedImage(data, height, width, (shard, key))


@dataclass
class ViewParams:
    """One view's draws: crop box (top, left, height, width) in the stored image, flip,
    the colour jitter's order and factors (NaN: not applied), grayscale, blur sigma."""

    image: EncodedImage
    box: tuple[int, int, int, int]
    flip: bool
    order: list[int]
    factors: list[float]  # indexed by BRIGHTNESS, CONTRAST, SATURATION, HUE
    grayscale: bool
    sigma: float


class SimCLRParams:
    """``draw(image)`` per view under the view's seed, ``render(views)`` once per batch ->
    the batch entries ``encoded`` (the B images of the first views), ``encoded_from`` (their
    shards and keys), ``encoded_sizes`` (their stored heights and widths, from the headers)
    and ``view_params`` (tensors over the 2B views, first views then second views)."""

    rowwise = False  # a render is a piece's first views, then its second views

    def __init__(self, resolution: int, min_scale: float = 0.08, color_strength: float = 0.5,
                 grayscale: float = 0.2, blur: float = 0.5, flip: float = 0.5,
                 hue: float | None = None) -> None:
        self.recorded = RecordedSteps.of(resolution, min_scale, color_strength, grayscale,
                                         blur, flip, hue)
        crop, flip_step = self.recorded.steps[:2]  # recorders too: no pixels are touched
        self.crop, self.flip = recording(crop), recording(flip_step)

    def draw(self, image: EncodedImage) -> ViewParams:
        """Consumes the random stream exactly as ``simclr_view`` does for an image of
        ``image``'s size (the placeholder below has that shape and no memory)."""
        rec = self.recorded
        rec.start()
        placeholder = torch.empty((3, 1, 1), dtype=torch.uint8).expand(
            3, image.height, image.width)
        for step in rec.steps:
            step(placeholder)
        box, jitter = self.crop.recorded, rec.jitter.recorded
        factors = [math.nan] * 4
        order = [0, 1, 2, 3]
        if jitter is not None:
            order = [int(i) for i in jitter["fn_idx"]]
            for index, name in FACTOR_NAMES.items():
                if jitter[name] is not None:
                    factors[index] = float(jitter[name])
        return ViewParams(image, (box["top"], box["left"], box["height"], box["width"]),
                          self.flip.recorded is not None, order, factors,
                          rec.gray.recorded is not None,
                          math.nan if rec.blur.recorded is None
                          else float(rec.blur.recorded["sigma"]))

    def render(self, views: list[ViewParams]) -> dict[str, Any]:
        half = len(views) // 2
        assert all(a.image is b.image for a, b in zip(views[:half], views[half:], strict=True))
        return {"encoded": [v.image.data for v in views[:half]],
                "encoded_from": [v.image.source for v in views[:half]],
                "encoded_sizes": [(v.image.height, v.image.width) for v in views[:half]],
                "view_params": {
            "box": torch.tensor([v.box for v in views], dtype=torch.int64),  # [2B, 4]
            "flip": torch.tensor([v.flip for v in views]),  # [2B] bool
            "order": torch.tensor([v.order for v in views], dtype=torch.int64),  # [2B, 4]
            "factors": torch.tensor([v.factors for v in views], dtype=torch.float64),
            "grayscale": torch.tensor([v.grayscale for v in views]),  # [2B] bool
            "sigma": torch.tensor([v.sigma for v in views], dtype=torch.float64),  # [2B]
        }}

