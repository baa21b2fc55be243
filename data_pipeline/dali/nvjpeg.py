"""The main process's half of the torchvision device backend (``data.backend=nvjpeg``):
decode, crop and colour on the run's device with torchvision alone.

Each batch's JPEGs are decoded in one call of ``torchvision.io.decode_jpeg`` on the run's
device (nvJPEG, batched, on CUDA; libjpeg-turbo on the CPU); other formats (PNG, WebP) are
decoded on the CPU and moved, and counted (:attr:`NvjpegViews.cpu_decoded`). Every view's
crop box is resized to ``R x R`` in one batched call: the decoded images are stacked into
one zero-padded tensor and ``torchvision.ops.roi_align`` samples each box on an ``R x R``
grid of bins, averaging ``ceil(box / R)`` bilinear samples a bin on each axis (an area
filter when it shrinks, bilinear when it grows). The colour steps then run batched in
torch (``colour.py``), as for the DALI backend. The workers' side is the DALI backend's:
headers read, every view's parameters drawn (``params.py``), so resume stays exact.

A body that fails to decode fails the batch's call; the batch is then decoded image by
image, and the undecodable instances are dropped with both views and counted as
``corrupt_image`` (``device.rendered``), leaving the workers' stream untouched.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torchvision.io import ImageReadMode, decode_image, decode_jpeg
from torchvision.ops import roi_align

from data_pipeline.dali.device import rendered

JPEG_MAGIC = b"\xff\xd8\xff"


class NvjpegViews:
    """``views(batch) -> batch`` with ``images`` on ``device`` in place of ``encoded`` and
    ``view_params``."""

    def __init__(self, resolution: int, kernel_size: int, device: torch.device) -> None:
        self.resolution, self.kernel_size, self.device = resolution, kernel_size, device
        self.cpu_decoded = 0  # images not decoded on the device (not JPEG)

    def decode(self, encoded: list[bytes]) -> list[Tensor]:
        """[3, H, W] uint8 images on the device, as stored (no EXIF rotation: the boxes
        were drawn on the stored size); raises when one does not decode."""
        data = [torch.frombuffer(bytearray(item), dtype=torch.uint8) for item in encoded]
        jpeg = [i for i, item in enumerate(encoded) if item[:3] == JPEG_MAGIC]
        images: list[Tensor | None] = [None] * len(encoded)
        if jpeg:
            decoded = decode_jpeg([data[i] for i in jpeg], mode=ImageReadMode.RGB,
                                  device=self.device)
            for i, image in zip(jpeg, decoded, strict=True):
                images[i] = image
        for i, image in enumerate(images):
            if image is None:
                images[i] = decode_image(data[i], mode=ImageReadMode.RGB).to(self.device)
                self.cpu_decoded += 1
        return images

    def crops(self, encoded: list[bytes], boxes: Tensor) -> Tensor:
        """B encoded images and boxes [2B, 4] (top, left, height, width) of the first
        views then the second -> the crops [2B, 3, R, R] uint8, cut in one batched call;
        raises when an image does not decode."""
        images = self.decode(encoded)
        height = max(image.shape[1] for image in images)
        width = max(image.shape[2] for image in images)
        padded = torch.zeros(len(images), 3, height, width, device=self.device)
        for i, image in enumerate(images):
            padded[i, :, :image.shape[1], :image.shape[2]] = image
        boxes = boxes.to(torch.float32)
        top, left, tall, wide = boxes.unbind(1)
        index = torch.arange(len(images), dtype=torch.float32).repeat(2)
        rois = torch.stack([index, left, top, left + wide, top + tall], dim=1)
        crops = roi_align(padded, rois.to(self.device), self.resolution, aligned=True,
                          sampling_ratio=-1)
        return crops.round_().clamp_(0, 255).to(torch.uint8)

    def decodes(self, data: bytes) -> bool:
        try:
            self.decode([data])
        except RuntimeError:
            return False
        return True

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        return rendered(batch, self.crops, self.decodes, self.kernel_size,
                        "torchvision cannot decode it")
