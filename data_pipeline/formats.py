"""What a shard sample is: its image fields, and the exception that skips a bad one.

A sample is the run of tar members sharing a ``__key__``: one image (``jpg``, ``jpeg``,
``png`` or ``webp``), optional ``txt`` (caption, UTF-8), ``cls`` (class label) and ``json``
(metadata): the layout img2dataset writes.
"""

from __future__ import annotations

from dataclasses import dataclass

IMAGE_FIELDS = ("jpg", "jpeg", "png", "webp")
IMAGE_SUFFIXES = {".jpg": "jpg", ".jpeg": "jpg", ".png": "png", ".webp": "webp"}  # file -> field


class SkipSample(Exception):
    """A sample that cannot be used; ``reason`` is the counter it goes to."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason, self.detail = reason, detail


def image_of(sample: dict) -> bytes | None:
    """The encoded image of a raw ``{"__key__", "jpg", ...}`` sample, or None."""
    return next((sample[f] for f in IMAGE_FIELDS if f in sample), None)


@dataclass(frozen=True)
class Sample:
    key: str  # unique and stable; no dots (WebDataset splits the key at the first dot)
    image: bytes
    ext: str  # jpg, png or webp
    label: int | None = None
    caption: str | None = None
