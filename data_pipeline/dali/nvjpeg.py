"""The main process's half of the torchvision device backend (``data.backend=nvjpeg``):
decode, crop and colour on the run's device.

A batch's images are decoded a chunk at a time, each chunk at most
``data.device_decode_pixels`` pixels (or one image larger than that): its JPEGs in one call
of the JPEG decoder (``data.decoder``, :mod:`.jpeg`: nvJPEG, batched, on CUDA; libjpeg-turbo
on the CPU), other formats (PNG, WebP) by Pillow and moved, and counted
(:attr:`NvjpegViews.cpu_decoded`). Each image's two crop boxes are resized to ``R x R`` by
``torchvision.ops.roi_align`` on the part of the image they span, in float32: it samples
each box on an ``R x R`` grid of bins, averaging ``ceil(box / R)`` bilinear samples a bin on
each axis (an area filter when it shrinks, bilinear when it grows). So a batch's memory on
the device is at most 3 bytes a pixel of one chunk, 12 bytes a pixel of the largest span of
one image's boxes, and the crops, whatever the mix of sizes and orientations (no image is
padded to another's size). The colour steps then run batched in torch (``colour.py``), as
for the DALI backend. The workers' side is the DALI backend's: headers read, every view's
parameters drawn (``params.py``), so resume stays exact.

A JPEG the device decoder refuses alone is decoded by Pillow; one Pillow cannot decode
either is dropped with both views and counted as ``corrupt_image``
(``device.rendered``), leaving the workers' stream untouched. The device refusing all of
two or more JPEGs of a chunk that Pillow decodes, running out of memory, or a decoded size
other than the header's stops the run in one line (:class:`RenderError`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor
from torchvision.ops import roi_align

from data_pipeline.dali.colour import on_device
from data_pipeline.dali.device import (
    RenderError,
    cpu_decodes,
    described,
    first_line,
    rendered,
)
from data_pipeline.dali.jpeg import JPEG_DECODERS, decoder_name
from data_pipeline.formats import SkipSample
from data_pipeline.transforms import decode

JPEG_MAGIC = b"\xff\xd8\xff"


class NvjpegViews:
    """``views(batch) -> batch`` with ``images`` on ``device`` in place of ``encoded`` and
    ``view_params``."""

    undecodable = "the decoder cannot decode it"
    memory_setting = "data.device_decode_pixels or data.batch_size"

    def __init__(self, resolution: int, kernel_size: int, device: torch.device,
                 decoder: str = "auto", decode_pixels: int = 100_000_000) -> None:
        self.resolution, self.kernel_size, self.device = resolution, kernel_size, device
        self.decoder = decoder_name(decoder)
        self.decode_jpegs = JPEG_DECODERS[self.decoder].decode
        self.decode_pixels = decode_pixels
        self.cpu_decoded = 0  # images Pillow decoded: not JPEG, or refused by the device

    def decode(self, encoded: list[bytes]) -> list[Tensor]:
        """[3, H, W] uint8 images on the device, as stored (no EXIF rotation: the boxes
        were drawn on the stored size). The JPEGs go to the device decoder in one call and,
        where that fails, one at a time; a JPEG it refuses alone is decoded by Pillow, as
        other formats are, and moved (:attr:`cpu_decoded`). Raises SkipSample when Pillow
        cannot decode one either, and :class:`RenderError` when the device refuses every
        one of two or more JPEGs of which Pillow decodes any (the device fails, not them)."""
        images: list[Tensor | None] = [None] * len(encoded)
        jpeg = [i for i, item in enumerate(encoded) if item[:3] == JPEG_MAGIC]
        refusal = ""
        if jpeg:
            decoded, refusal = self.device_jpegs([encoded[i] for i in jpeg])
            for i, image in zip(jpeg, decoded, strict=True):
                images[i] = image
        refused = [i for i in jpeg if images[i] is None]
        if len(jpeg) > 1 and len(refused) == len(jpeg) and any(
                cpu_decodes(encoded[i]) for i in refused):
            raise RenderError(f"the device decoder ({self.decoder}) refused all {len(jpeg)} "
                              f"JPEGs of a chunk that Pillow decodes: {refusal}")
        for i, image in enumerate(images):
            if image is None:
                images[i] = decode(encoded[i], "a device batch").to(self.device)
                self.cpu_decoded += 1
        return images

    def device_jpegs(self, encoded: list[bytes]) -> tuple[list[Tensor | None], str]:
        """Each JPEG decoded on the device, None where the decoder refuses it alone; and the
        first line of the refusal of them all in one call ("" if none)."""
        data = [torch.frombuffer(bytearray(item), dtype=torch.uint8) for item in encoded]
        try:
            return list(self.decode_jpegs(data, self.device)), ""
        except torch.OutOfMemoryError:
            raise
        except RuntimeError as error:
            if len(data) == 1:
                return [None], first_line(error)
            alone = [self.device_jpegs([item]) for item in encoded]
            return [images[0] for images, _ in alone], first_line(error)

    def device_params(self, boxes: Tensor, sizes: list[tuple[int, int]]) -> list[Tensor]:
        """The boxes as ``roi_align`` reads them, [B, 2, 5] (:func:`box_spans`)."""
        return [box_spans(by_image(boxes), sizes)[1]]

    def crops(self, encoded: list[bytes], boxes: Tensor, sizes: list[tuple[int, int]],
              moved: list[Tensor] | None = None) -> Tensor:
        """B encoded images of ``sizes`` (height, width, from their headers) and boxes
        [2B, 4] (top, left, height, width) of the first views then the second -> the crops
        [2B, 3, R, R] uint8; ``moved``: :meth:`device_params` on the device, else copied
        here. Raises when an image does not decode."""
        half, r = len(encoded), self.resolution
        spans, rois = box_spans(by_image(boxes), sizes)
        rois = on_device([rois], self.device)[0] if moved is None else moved[0]
        out = torch.empty(2, half, 3, r, r, dtype=torch.uint8, device=self.device)
        for chunk in pixel_chunks(sizes, self.decode_pixels):
            for i, image in zip(chunk, self.decode([encoded[i] for i in chunk]), strict=True):
                if tuple(image.shape[1:]) != tuple(sizes[i]):
                    raise RenderError(f"image {i} of {described(sizes)} decoded as "
                                      f"{image.shape[2]}x{image.shape[1]}, its header says "
                                      f"{sizes[i][1]}x{sizes[i][0]} (width x height)")
                out[:, i] = span_crops(image, spans[i], rois[i], r)
            del image  # the chunk's last image, before the next chunk is decoded
        return out.view(2 * half, 3, r, r)

    def decodes(self, data: bytes) -> bool:
        """Whether the image decodes, on the device or (refused there) by Pillow."""
        try:
            self.decode([data])
        except torch.OutOfMemoryError:
            raise
        except (RuntimeError, SkipSample):
            return False
        return True

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        return rendered(batch, self)


def pixel_chunks(sizes: list[tuple[int, int]], pixels: int) -> Iterator[list[int]]:
    """Consecutive runs of image indices, each at most ``pixels`` pixels in all or a
    single image."""
    chunk: list[int] = []
    held = 0
    for i, (height, width) in enumerate(sizes):
        if chunk and held + height * width > pixels:
            yield chunk
            chunk, held = [], 0
        chunk.append(i)
        held += height * width
    if chunk:
        yield chunk


def by_image(boxes: Tensor) -> Tensor:
    """Boxes [2B, 4] of the first views then the second -> [B, 2, 4], each image's two."""
    return boxes.reshape(2, len(boxes) // 2, 4).transpose(0, 1)


def box_spans(boxes: Tensor, sizes: list[tuple[int, int]]
              ) -> tuple[list[list[int]], Tensor]:
    """Each image's boxes [B, K, 4] (top, left, height, width) -> the part of the image
    they span, with a pixel of margin (a bin's bilinear samples read up to one pixel past
    its box), as [y0, y1, x0, x1]; and the boxes as ``roi_align`` takes them on that part,
    [B, K, 5] float32 (batch index 0, x1, y1, x2, y2). So ``roi_align`` on the part equals
    ``roi_align`` on the whole image, up to the float rounding of its sample positions."""
    top, left, tall, wide = boxes.to(torch.float32).unbind(-1)  # [B, K] each
    height, width = torch.tensor(sizes, dtype=torch.float32).reshape(-1, 2).unbind(1)
    y0 = (top.amin(1) - 1).clamp(min=0)[:, None]
    x0 = (left.amin(1) - 1).clamp(min=0)[:, None]
    y1 = torch.minimum(height, (top + tall).amax(1) + 1)
    x1 = torch.minimum(width, (left + wide).amax(1) + 1)
    rois = torch.stack([torch.zeros_like(top), left - x0, top - y0, left - x0 + wide,
                        top - y0 + tall], dim=-1)
    spans = torch.stack([y0[:, 0], y1, x0[:, 0], x1], dim=1).to(torch.int64).tolist()
    return spans, rois


def span_crops(image: Tensor, span: list[int], rois: Tensor,
               resolution: int) -> Tensor:
    """[3, H, W] uint8, the part its boxes span and the boxes there [K, 5] -> [K, 3, R, R]
    uint8 (the part in float32 only while it is sampled)."""
    y0, y1, x0, x1 = span
    part = image[None, :, y0:y1, x0:x1].to(torch.float32)
    crops = roi_align(part, rois, resolution, aligned=True, sampling_ratio=-1)
    return crops.round_().clamp_(0, 255).to(torch.uint8)
