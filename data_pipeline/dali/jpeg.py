"""The JPEG decoders of the torchvision device backend (``data.decoder``): each takes a
batch's encoded JPEGs (1-D uint8 tensors on the host) and returns their [3, H, W] uint8 RGB
images on the device, as stored (no EXIF rotation: the crop boxes were drawn on the stored
size).

- ``torchcodec``: TorchCodec's ``decode_jpeg``, batched nvJPEG on CUDA, libjpeg-turbo on the
  CPU. Its nvJPEG path waits for the caller's stream before the decode writes its outputs
  (meta-pytorch/torchcodec PR #1634). Decoding images needs no FFmpeg. It turns an image
  by its EXIF orientation, so each JPEG goes to it without its EXIF segments
  (:func:`without_exif`).
- ``torchvision``: ``torchvision.io.decode_jpeg``. Its CUDA path allocates the outputs on the
  caller's stream and has nvJPEG write them from a stream of its own without waiting for
  the caller's (pytorch/vision PR #9606, closed unmerged): the caching allocator can hand it
  a block that kernels queued on the caller's stream still read. So the caller's stream is
  synchronised first: nothing queued on it still reads a block the decoder is handed.

``auto`` takes TorchCodec where it is installed and loads, torchvision otherwise. Adding a
decoder is its function and an entry in :data:`JPEG_DECODERS`.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from core.config import InvalidValue


@dataclass(frozen=True)
class JpegDecoder:
    decode: Callable[[list[Tensor], torch.device], list[Tensor]]
    available: Callable[[], bool]
    install_hint: str  # how to get it where it is missing


def torchcodec_jpegs(data: list[Tensor], device: torch.device) -> list[Tensor]:
    from torchcodec.decoders import decode_jpeg

    return decode_jpeg([without_exif(one) for one in data], mode="RGB", device=device)


APP1, START_OF_SCAN, EXIF = 0xE1, 0xDA, b"Exif\0\0"
STANDALONE = {0x01, *range(0xD0, 0xD8)}  # markers without a length (TEM, RSTn)


def without_exif(jpeg: Tensor) -> Tensor:
    """A JPEG's bytes [n] uint8 without its APP1 ``Exif`` segments (where a decoder would
    read an orientation); the same tensor when it has none. Only the headers before the
    scan are walked: a malformed one is left to the decoder to refuse."""
    data = memoryview(jpeg.numpy())
    kept, pos, dropped = bytearray(data[:2]), 2, False
    while pos + 4 <= len(data) and data[pos] == 0xFF:
        marker = data[pos + 1]
        if marker == 0xFF:  # a fill byte
            pos += 1
            continue
        if marker in STANDALONE:
            kept += data[pos:pos + 2]
            pos += 2
            continue
        if marker == START_OF_SCAN:
            break
        end = pos + 2 + int.from_bytes(data[pos + 2:pos + 4], "big")
        if marker == APP1 and data[pos + 4:pos + 10] == EXIF:
            dropped = True
        else:
            kept += data[pos:end]
        pos = end
    if not dropped:
        return jpeg
    kept += data[pos:]
    return torch.frombuffer(kept, dtype=torch.uint8)


def torchvision_jpegs(data: list[Tensor], device: torch.device) -> list[Tensor]:
    from torchvision.io import ImageReadMode, decode_jpeg

    if device.type == "cuda":  # the decoder does not order its writes after this stream
        torch.cuda.current_stream(device).synchronize()
    return decode_jpeg(data, mode=ImageReadMode.RGB, device=device)


@functools.cache
def torchcodec_loads() -> bool:
    """Whether TorchCodec is installed and its decoders load against this torch (each of
    its wheels is built for one torch release)."""
    if importlib.util.find_spec("torchcodec") is None:
        return False
    try:
        import torchcodec.decoders  # noqa: F401
    except Exception:  # noqa: BLE001 - any failure to load leaves torchvision's decoder
        return False
    return True


JPEG_DECODERS: dict[str, JpegDecoder] = {
    "torchcodec": JpegDecoder(torchcodec_jpegs, torchcodec_loads,
                              "pip install torchcodec (no FFmpeg needed for images)"),
    "torchvision": JpegDecoder(torchvision_jpegs, lambda: True, ""),
}
DECODER_CHOICES = ("auto", *JPEG_DECODERS)


def check_decoder(name: str) -> None:
    """:class:`InvalidValue` for ``data.decoder`` unless ``name`` is one of the choices."""
    if name not in DECODER_CHOICES:
        raise InvalidValue("decoder", f"unknown decoder {name!r}; choose one of "
                                      f"{', '.join(DECODER_CHOICES)}")


def decoder_name(name: str) -> str:
    """The decoder ``name`` stands for: ``auto`` is TorchCodec where installed."""
    if name != "auto":
        return name
    return "torchcodec" if JPEG_DECODERS["torchcodec"].available() else "torchvision"

