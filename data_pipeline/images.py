"""Opening encoded images from outside: only the formats we mean to read, sizes judged
from the header before any pixel is decoded.

Every image this project opens (shard samples, image trees, caption tables, served
requests) goes through :func:`opened_image`. It hands Pillow ``formats=ACCEPTED``, so no
other plugin ever sees the bytes (an EPS file never reaches Ghostscript), names the format
of a refused file from its magic bytes alone, and judges the pixel count from the header:
a decompression bomb is a few KB that would decode to gigabytes.

Pillow's process-wide ``Image.MAX_IMAGE_PIXELS`` is never changed here (a threaded server
would race on it): our limit is checked from the header, and Pillow's own check (an error
above 2 x its limit, about 179M pixels) stays as a backstop, reported as a skip too.
"""

from __future__ import annotations

import io
import re
from collections.abc import Iterator
from contextlib import contextmanager

from PIL import Image, UnidentifiedImageError

from data_pipeline.formats import SkipSample

ACCEPTED = ("JPEG", "PNG", "WEBP")  # Pillow format names; docs/data_pipeline.md lists them
ACCEPTED_TEXT = "JPEG, PNG or WebP"
PILLOW_MAX_PIXELS = 89_478_485  # Pillow's default decompression-bomb limit
PILLOW_HARD_LIMIT = 2 * PILLOW_MAX_PIXELS  # above this Pillow refuses to open at all
ADDRESS = re.compile(r"<[^<>]* at 0x[0-9a-fA-F]+>")  # "<_io.BytesIO object at 0x7f...>"


def format_of(data: bytes) -> str | None:
    """The Pillow format whose magic bytes ``data`` starts with (by each plugin's
    ``accept`` test on the first 16 bytes, no plugin code beyond it), or None."""
    Image.init()
    prefix = data[:16]
    for name, (_, accept) in Image.OPEN.items():
        try:
            if accept is not None and accept(prefix):
                return name
        except Exception:  # an accept test that cannot read this prefix: not that format
            continue
    return None


def refusal(data: bytes) -> str:
    """Why Pillow did not identify ``data`` among the accepted formats, in a few words."""
    found = format_of(data)
    if found is not None and found not in ACCEPTED:
        return f"format {found} is not accepted (send {ACCEPTED_TEXT})"
    return f"not a readable {ACCEPTED_TEXT} image"


def clean(message: object) -> str:
    """An error message with heap addresses removed, first line only."""
    lines = str(message).strip().splitlines()
    return ADDRESS.sub("the data", lines[0]) if lines else ""


@contextmanager
def opened_image(data: bytes, where: str,
                 max_pixels: int = PILLOW_MAX_PIXELS) -> Iterator[Image.Image]:
    """``data`` opened by Pillow as one of :data:`ACCEPTED` for the body to read;
    SkipSample('corrupt_image') naming ``where`` when it is another format, undecodable,
    or has more than ``max_pixels`` pixels (0: Pillow's own limit alone)."""
    try:
        with Image.open(io.BytesIO(data), formats=ACCEPTED) as image:
            width, height = image.size
            if max_pixels and width * height > max_pixels:
                raise SkipSample("corrupt_image", f"{where}: {width} x {height} = "
                                 f"{width * height} pixels exceed the limit of {max_pixels} "
                                 "(data.max_image_pixels, shards.max_image_pixels)")
            yield image
    except UnidentifiedImageError:
        raise SkipSample("corrupt_image", f"{where}: {refusal(data)}") from None
    except Image.DecompressionBombError as err:  # over Pillow's own hard limit
        found = re.search(r"\((\d+) pixels\)", str(err))
        raise SkipSample("corrupt_image", f"{where}: {found.group(1) if found else 'more'} "
                         f"pixels exceed the limit of {max_pixels or PILLOW_HARD_LIMIT} "
                         "(data.max_image_pixels, shards.max_image_pixels)") from None
    except (OSError, SyntaxError, ValueError, EOFError) as err:
        raise SkipSample("corrupt_image", f"{where}: {clean(err)}") from None


def check_image(data: bytes, where: str, max_pixels: int = PILLOW_MAX_PIXELS) -> None:
    """Raise SkipSample('corrupt_image') unless ``data`` decodes as an accepted image of at
    most ``max_pixels`` pixels."""
    if not data:
        raise SkipSample("missing_image", where)
    with opened_image(data, where, max_pixels) as image:
        image.load()
