"""The main process's half of the DALI backend: decode, crop and colour on the device.

NVIDIA DALI (its dynamic, eager API) decodes each batch's encoded images once, with
nvJPEG on the GPU (``mixed`` decoder) when the run's device is CUDA and with its CPU
decoder otherwise, and resizes each view's crop box to ``R x R`` (linear, antialiased:
torchvision's ``RandomResizedCrop`` up to interpolation rounding). The colour steps then
run batched in torch on the same device (``data_pipeline/dali/colour.py``). The result is
the CPU path's batch contract: ``images`` [2B, 3, R, R] float32 normalised, first views
then second views, beside the unchanged ids, labels, captions and caption rows.

A body that fails to decode (the workers only read headers) fails the batch's DALI call;
the batch is then decoded image by image, and the undecodable instances are dropped from it
and counted as ``corrupt_image`` skips. The workers' stream is unchanged by the drop (the
gathering boundary accepts ranks with different row counts), so resume stays exact.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import Tensor

from data_pipeline.dali import INSTALL_HINT, dali_available
from data_pipeline.dali.colour import render_colour


class DaliViews:
    """``views(batch) -> batch`` with ``images`` on ``device`` in place of ``encoded`` and
    ``view_params``."""

    def __init__(self, resolution: int, kernel_size: int, device: torch.device,
                 threads: int = 2) -> None:
        if not dali_available():
            raise RuntimeError(f"data.backend={INSTALL_HINT}")
        import nvidia.dali.experimental.dynamic as ndd
        from nvidia.dali import types

        self.ndd, self.types = ndd, types
        self.resolution, self.kernel_size, self.device = resolution, kernel_size, device
        if device.type == "cuda":
            index = torch.cuda.current_device() if device.index is None else device.index
            # DALI's dynamic API names the GPU "gpu" (nvJPEG is its "mixed" backend)
            self.dali_device = f"gpu:{index}"
            self.context = ndd.EvalContext(device_id=index, num_threads=threads,
                                           cuda_stream=torch.cuda.current_stream(device))
        else:
            self.dali_device = "cpu"
            self.context = ndd.EvalContext(num_threads=threads)

    def crops(self, encoded: list[bytes], boxes: Tensor) -> Tensor:
        """B encoded images and boxes [2B, 4] (top, left, height, width) -> the crops
        [2B, 3, R, R] uint8 on the device; raises when an image does not decode."""
        ndd = self.ndd
        with self.context:
            images = self.decode(encoded)
            half = len(encoded)
            views = []
            for rows in (slice(0, half), slice(half, 2 * half)):
                start = boxes[rows, :2].to(torch.float32)
                end = start + boxes[rows, 2:].to(torch.float32)
                views.append(ndd.resize(
                    images, size=[self.resolution, self.resolution],
                    roi_start=ndd.as_batch(start.numpy()), roi_end=ndd.as_batch(end.numpy()),
                    roi_relative=False, antialias=True,
                    interp_type=self.types.INTERP_LINEAR).torch())
        return torch.cat(views).to(self.device).permute(0, 3, 1, 2).contiguous()

    def decode(self, encoded: list[bytes]) -> Any:
        """DALI's batch of [H, W, 3] uint8 images, as stored (EXIF orientation is not
        applied: the crop boxes were drawn on the stored size, as the CPU path decodes)."""
        return self.ndd.decoders.image(
            self.ndd.batch([np.frombuffer(data, np.uint8) for data in encoded]),
            device=self.dali_device,
            output_type=self.types.RGB, adjust_orientation=False)

    def decodes(self, data: bytes) -> bool:
        try:
            with self.context:
                self.decode([data]).evaluate()
        except RuntimeError:
            return False
        return True

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        return rendered(batch, self.crops, self.decodes, self.kernel_size,
                        "DALI cannot decode it")


def rendered(batch: dict[str, Any], crops: Callable[[list[bytes], Tensor], Tensor],
             decodes: Callable[[bytes], bool], kernel_size: int, why: str) -> dict[str, Any]:
    """``batch`` with ``images`` [2B, 3, R, R] in place of ``encoded`` and ``view_params``:
    ``crops(encoded, boxes)`` decodes and crops; where that fails, the images ``decodes``
    refuses one at a time are dropped (:func:`drop_instances`, counted with ``why``), and
    the rest cropped. Then the colour steps."""
    encoded, params = batch.pop("encoded"), batch.pop("view_params")
    try:
        views = crops(encoded, params["box"])
    except RuntimeError:
        bad = [i for i, data in enumerate(encoded) if not decodes(data)]
        if not bad:
            raise
        batch, encoded, params = drop_instances(batch, encoded, params, bad, why)
        views = crops(encoded, params["box"])
    del batch["encoded_from"]
    batch["images"] = render_colour(views, params, kernel_size)
    return batch


PER_INSTANCE = ("keys", "captions", "encoded_from")  # lists of B; 2B-row tensors: per view


def drop_instances(batch: dict[str, Any], encoded: list[bytes],
                   params: dict[str, Tensor], bad: list[int],
                   why: str,
                   ) -> tuple[dict[str, Any], list[bytes], dict[str, Tensor]]:
    """The batch without instances ``bad`` (both views), each counted as a skip."""
    keep = [i not in bad for i in range(len(encoded))]
    views = torch.tensor(keep).repeat(2)
    out = dict(batch)
    for name, value in batch.items():
        if isinstance(value, Tensor) and value.shape[:1] == views.shape:
            out[name] = value[views]
        elif name in PER_INSTANCE:
            out[name] = [v for v, k in zip(value, keep, strict=True) if k]
    out["skipped"] = dict(batch["skipped"])
    out["skipped_places"] = dict(batch["skipped_places"])
    out["skipped_examples"] = list(batch["skipped_examples"])
    out["skipped_samples"] = list(batch.get("skipped_samples", []))
    for i in bad:
        shard, key = batch["encoded_from"][i]
        for entry, name in ((out["skipped"], "corrupt_image"),
                            (out["skipped_places"], f"corrupt_image {shard}")):
            entry[name] = entry.get(name, 0) + 1
        out["skipped_examples"].append(f"corrupt_image {shard} {key}: {why}")
        out["skipped_samples"].append((("corrupt_image", shard, f"{key}: {why}"), 1))
    return (out, [e for e, k in zip(encoded, keep, strict=True) if k],
            {name: value[views] for name, value in params.items()})
