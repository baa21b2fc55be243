"""The table of training-view backends (``data.backend``): where a batch's two views are
made, and what that needs. Adding a backend is its renderer, an entry here, its test and
a line in ``docs/data_pipeline.md``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from core.config import InvalidValue
from core.tables import table_entry
from data_pipeline.config import DataConfig
from data_pipeline.dali import INSTALL_HINT, dali_available
from data_pipeline.dali.device import DaliViews
from data_pipeline.dali.jpeg import JPEG_DECODERS, check_decoder, decoder_name
from data_pipeline.dali.nvjpeg import NvjpegViews
from data_pipeline.transforms import view_kernel_size

# (data.*, the device batches go to) -> the main process's renderer of the views
DeviceViews = Callable[[DataConfig, torch.device], Callable[[dict[str, Any]], dict[str, Any]]]


def no_check(cfg: DataConfig) -> None:
    """A backend with no data.* keys of its own to check."""


@dataclass(frozen=True)
class BackendSpec:
    """A backend and what it needs. Without ``device_views`` the loader workers decode
    and render the views; with it they send each image still encoded and the views'
    drawn parameters, and the main process renders them on the batch's device."""

    device_views: DeviceViews | None = None
    # a fork would copy the backend's threads half-alive: workers start by forkserver
    forkserver: bool = False
    check: Callable[[DataConfig], None] = no_check  # its data.* keys, before any work


def simclr_views_check(cfg: DataConfig) -> None:
    """A device backend renders SimCLR views of one image."""
    if (cfg.augment, cfg.pairing) != ("simclr", "views"):
        raise InvalidValue("backend", f"{cfg.backend} renders SimCLR views of one image: "
                                      "needs data.augment=simclr and data.pairing=views")


def nvjpeg_check(cfg: DataConfig) -> None:
    simclr_views_check(cfg)
    check_decoder(cfg.decoder)
    decoder = JPEG_DECODERS[decoder_name(cfg.decoder)]
    if not decoder.available():
        raise InvalidValue("decoder", f"{cfg.decoder} is not installed: {decoder.install_hint}")


def dali_check(cfg: DataConfig) -> None:
    simclr_views_check(cfg)
    if not dali_available():
        raise InvalidValue("backend", INSTALL_HINT)


BACKENDS: dict[str, BackendSpec] = {
    "cpu": BackendSpec(),
    "dali": BackendSpec(  # nvJPEG and the views on the GPU (DALI's CPU operators without)
        lambda cfg, device: DaliViews(cfg.resolution, view_kernel_size(cfg.resolution),
                                      device, max(1, cfg.workers)),
        forkserver=True, check=dali_check),
    "nvjpeg": BackendSpec(  # TorchCodec or torchvision: nvJPEG on CUDA (libjpeg-turbo without)
        lambda cfg, device: NvjpegViews(cfg.resolution, view_kernel_size(cfg.resolution),
                                        device, cfg.decoder, cfg.device_decode_pixels),
        forkserver=True, check=nvjpeg_check),  # its render thread (loader/ahead.py)
}


def backend_spec(name: str) -> BackendSpec:
    """The entry of backend ``name``; :class:`InvalidValue` for ``backend`` naming the
    choices, if there is none."""
    return table_entry(BACKENDS, name, "backend", "backend")
