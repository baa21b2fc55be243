"""The main process's half of the DALI backend: decode, crop and colour on the device.

NVIDIA DALI (its dynamic, eager API) decodes each batch's encoded images once, with
nvJPEG on the GPU (``mixed`` decoder) when the run's device is CUDA and with its CPU
decoder otherwise, and resizes each view's crop box to ``R x R`` (linear, antialiased:
torchvision's ``RandomResizedCrop`` up to interpolation rounding). The colour steps then
run batched in torch on the same device (``data_pipeline/dali/colour.py``). The result is
the CPU path's batch contract: ``images`` [2B, 3, R, R] float32 normalised, first views
then second views, beside the unchanged ids, labels, captions and caption rows.

A body that fails to decode (the workers only read headers) fails the batch's DALI call;
the batch is then decoded image by image, and an image that fails alone, and on the CPU
decoder too, is dropped from it and counted as a ``corrupt_image`` skip (:func:`rendered`).
The workers' stream is unchanged by the drop (the gathering boundary accepts ranks with
different row counts), so resume stays exact. Running out of device memory, or failing an
image the CPU decodes (a device error), stops the run in one line.
"""

from __future__ import annotations

import itertools
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor

from data_pipeline.dali import INSTALL_HINT, dali_available
from data_pipeline.dali.colour import apply_colour, colour_plan, on_device
from data_pipeline.formats import SkipSample
from data_pipeline.transforms import decode


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
        self.undecodable, self.memory_setting = "DALI cannot decode it", "data.batch_size"
        self.resolution, self.kernel_size, self.device = resolution, kernel_size, device
        self.threads = threads
        self._context: Any = None
        if device.type == "cuda":
            index = torch.cuda.current_device() if device.index is None else device.index
            # DALI's dynamic API names the GPU "gpu" (nvJPEG is its "mixed" backend)
            self.dali_device = f"gpu:{index}"
        else:
            self.dali_device = "cpu"

    @property
    def context(self) -> Any:
        """DALI's evaluation context, made on first use: on CUDA it works on the stream
        current then, the render thread's side stream (``loader/ahead.py``), which the
        trainer's stream waits for before it reads a batch."""
        if self._context is None:
            if self.device.type == "cuda":
                self._context = self.ndd.EvalContext(
                    device_id=int(self.dali_device.split(":")[1]), num_threads=self.threads,
                    cuda_stream=torch.cuda.current_stream(self.device))
            else:
                self._context = self.ndd.EvalContext(num_threads=self.threads)
        return self._context

    def device_params(self, boxes: Tensor, sizes: list[tuple[int, int]]) -> list[Tensor]:
        return []  # DALI reads the boxes on the host

    def crops(self, encoded: list[bytes], boxes: Tensor,
              sizes: list[tuple[int, int]] | None = None,
              moved: list[Tensor] | None = None) -> Tensor:
        """B encoded images and boxes [2B, 4] (top, left, height, width) -> the crops
        [2B, 3, R, R] uint8 on the device, the batch decoded at once (``sizes`` and
        ``moved`` unused); raises when an image does not decode."""
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
        except torch.OutOfMemoryError:
            raise
        except RuntimeError:
            return False
        return True

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        return rendered(batch, self)


class Renderer(Protocol):
    """What :func:`rendered` needs of a device backend."""

    device: torch.device
    kernel_size: int  # of the blur
    undecodable: str  # why a body it cannot decode is dropped
    memory_setting: str  # the data.* keys that bound a render's memory

    def device_params(self, boxes: Tensor, sizes: list[tuple[int, int]]) -> list[Tensor]:
        """Host tensors the crops read on the device."""

    def crops(self, encoded: list[bytes], boxes: Tensor, sizes: list[tuple[int, int]],
              moved: list[Tensor] | None = None) -> Tensor:
        """The crops [2B, 3, R, R] uint8 on the device; ``moved``: ``device_params`` there."""

    def decodes(self, data: bytes) -> bool: ...


class RenderError(RuntimeError):
    """The device failed a batch for a reason of its own (out of memory, or a device error
    on images the CPU decodes): the run stops, in one line."""


def rendered(batch: dict[str, Any], renderer: Renderer) -> dict[str, Any]:
    """``batch`` with ``images`` [2B, 3, R, R] in place of ``encoded`` and ``view_params``:
    the renderer decodes and crops, then the colour steps (:func:`render`). Where that
    fails, each image is tried alone, and an image is dropped (:func:`drop_instances`)
    only when it fails alone and Pillow cannot decode it either. Running out of memory, a
    failure no image explains, or failing images Pillow decodes, stops the run
    (:class:`RenderError`) in one line naming the batch's image sizes."""
    encoded, params = batch.pop("encoded"), batch.pop("view_params")
    sizes = batch["encoded_sizes"]
    try:
        images, batch = render_or_drop(batch, encoded, params, sizes, renderer)
    except torch.OutOfMemoryError as error:
        raise RenderError(f"rendering {described(sizes)} ran out of device memory: lower "
                          f"{renderer.memory_setting}") from error
    del batch["encoded_from"], batch["encoded_sizes"]
    batch["images"] = images
    return batch


def render_or_drop(batch: dict[str, Any], encoded: list[bytes], params: dict[str, Tensor],
                   sizes: list[tuple[int, int]], renderer: Renderer
                   ) -> tuple[Tensor, dict[str, Any]]:
    try:
        return render(renderer, encoded, params, sizes), batch
    except (RenderError, torch.OutOfMemoryError):
        raise
    except (RuntimeError, SkipSample) as error:
        bad = [i for i, data in enumerate(encoded) if not renderer.decodes(data)]
        if not bad:
            raise RenderError(f"the device failed {described(sizes)}, though each image "
                              f"decodes alone: {first_line(error)}") from error
        healthy = [i for i in bad if cpu_decodes(encoded[i])]
        if healthy:
            shard, key = batch["encoded_from"][healthy[0]]
            raise RenderError(f"the device failed {len(healthy)} image(s) of {described(sizes)} "
                              f"that Pillow decodes (first: {shard} {key}): "
                              f"{first_line(error)}") from error
    batch, encoded, params = drop_instances(batch, encoded, params, bad, renderer.undecodable)
    return render(renderer, encoded, params, batch["encoded_sizes"]), batch


def render(renderer: Renderer, encoded: list[bytes], params: dict[str, Tensor],
           sizes: list[tuple[int, int]]) -> Tensor:
    """The crops, then the colour steps; every host parameter they read on the device
    (the colour steps' rows and values, the crops' own) goes over in one copy."""
    plan = colour_plan(params, renderer.kernel_size)
    moved = on_device(plan.host + renderer.device_params(params["box"], sizes),
                      renderer.device)
    crops = renderer.crops(encoded, params["box"], sizes, moved[len(plan.host):])
    return apply_colour(crops, plan, moved[:len(plan.host)])


def described(sizes: list[tuple[int, int]]) -> str:
    """(height, width) each -> 'a batch of 8 images (14.2 MP; largest 4000x3000, width x
    height)'."""
    height, width = max(sizes, key=lambda size: size[0] * size[1])
    pixels = sum(h * w for h, w in sizes)
    return (f"a batch of {len(sizes)} images ({pixels / 1e6:.1f} MP; largest "
            f"{width}x{height}, width x height)")


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def cpu_decodes(data: bytes) -> bool:
    """Whether Pillow decodes the body as the CPU backend's workers do."""
    try:
        decode(data, "a device batch")
    except SkipSample:
        return False
    return True


# lists of B; the 2B-row tensors are per view
PER_INSTANCE = ("keys", "captions", "encoded_from", "encoded_sizes")


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
    if "chunk_sizes" in batch:  # the instances each chunk keeps
        ends = list(itertools.accumulate(batch["chunk_sizes"]))
        starts = [0, *ends[:-1]]
        out["chunk_sizes"] = [sum(keep[a:b]) for a, b in zip(starts, ends, strict=True)]
        out["placeholder"] = batch["placeholder"] or min(out["chunk_sizes"]) == 0
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
