"""Sample sources for make-shards: each maps an index to one encoded sample.

A source is cheap to build and pickle (paths or small arrays); ``load(i)`` does the I/O in a
worker process and raises :class:`SkipSample` with a reason for bad input, which is then
counted rather than written.
"""

from __future__ import annotations

import csv
import io
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError

from core.errors import RunError
from data_pipeline.config import ShardsConfig
from data_pipeline.formats import IMAGE_SUFFIXES, SkipSample

DIGIT_NAMES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


@dataclass(frozen=True)
class Sample:
    key: str  # unique and stable; no dots (WebDataset splits the key at the first dot)
    image: bytes
    ext: str  # jpg, png or webp
    label: int | None = None
    caption: str | None = None


def safe_key(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_\-]", "_", text)


def check_image(data: bytes, where: str) -> None:
    """Raise SkipSample('corrupt_image') unless ``data`` decodes as an image."""
    if not data:
        raise SkipSample("missing_image", where)
    try:
        with Image.open(io.BytesIO(data)) as image:
            image.load()
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as err:
        raise SkipSample("corrupt_image", f"{where}: {err}") from None


def check_caption(caption: str, where: str) -> str:
    caption = caption.strip()
    if not caption:
        raise SkipSample("bad_caption", f"{where}: empty caption")
    return caption


class DigitsSource:
    """scikit-learn's 1,797 real 8x8 handwritten digits, upsampled, as JPEG, with
    captions such as "a photo of the digit seven"."""

    def __init__(self, size: int, split: str = "all") -> None:
        from sklearn.datasets import load_digits

        digits = load_digits()
        index = np.arange(len(digits.target))
        if split != "all":
            index = index[(index % 5 == 0) == (split == "test")]
        self.index, self.size = index, size
        self.images = (digits.images[index] * (255 / 16)).astype(np.uint8)
        self.labels = digits.target[index].astype(int)
        self.class_names = list(DIGIT_NAMES)

    def __len__(self) -> int:
        return len(self.index)

    def load(self, i: int) -> Sample:
        image = Image.fromarray(self.images[i]).resize((self.size, self.size), Image.BILINEAR)
        buffer = io.BytesIO()
        image.convert("RGB").save(buffer, format="JPEG", quality=95)
        label = int(self.labels[i])
        return Sample(key=f"digits_{int(self.index[i]):05d}", image=buffer.getvalue(), ext="jpg",
                      label=label, caption=f"a photo of the digit {DIGIT_NAMES[label]}")


def read_class_names(spec: str, expected: int | None = None) -> list[str]:
    """``imagenet1k`` (torchvision's 1,000 names in class-index order) or a file, one per line."""
    if spec == "imagenet1k":
        from torchvision.models import ResNet50_Weights

        names = list(ResNet50_Weights.IMAGENET1K_V1.meta["categories"])
    else:
        path = Path(spec)
        if not path.is_file():
            raise FileNotFoundError(f"class-names file {path}: not found")
        names = [line.strip() for line in path.read_text(encoding="utf-8").splitlines()
                 if line.strip()]
    if expected is not None and len(names) != expected:
        raise ValueError(f"class names {spec}: {len(names)} names for {expected} class folders")
    return names


class ImageFolderSource:
    """``<root>/<class_dir>/*.JPEG``; label = index of the sorted class folder."""

    def __init__(self, root: str, class_names: str) -> None:
        root_path = Path(root)
        if not root_path.is_dir():
            raise FileNotFoundError(f"image tree {root_path}: not a directory")
        class_dirs = sorted(p.name for p in root_path.iterdir() if p.is_dir())
        self.class_names = (read_class_names(class_names, len(class_dirs)) if class_names
                            else class_dirs)
        self.items = [(path, label) for label, name in enumerate(class_dirs)
                      for path in sorted((root_path / name).iterdir())
                      if path.suffix.lower() in IMAGE_SUFFIXES]

    def __len__(self) -> int:
        return len(self.items)

    def load(self, i: int) -> Sample:
        path, label = self.items[i]
        data = path.read_bytes()
        check_image(data, str(path))
        return Sample(key=safe_key(f"{path.parent.name}_{path.stem}"), image=data,
                      ext=IMAGE_SUFFIXES[path.suffix.lower()], label=label,
                      caption=f"a photo of a {self.class_names[label]}")


class ImageURLs(RunError):
    """A caption table that lists image URLs instead of local files."""


class CaptionTableSource:
    """A CC3M/CC12M-style CSV or TSV table of caption and local image path."""

    def __init__(self, cfg: ShardsConfig) -> None:
        table = Path(cfg.input)
        if not table.is_file():
            raise FileNotFoundError(f"caption table {table}: not found")
        delimiter = cfg.delimiter or ("\t" if table.suffix.lower() == ".tsv" else ",")
        with open(table, newline="", encoding="utf-8", errors="replace") as handle:
            rows = list(csv.reader(handle, delimiter=delimiter))
        header = rows.pop(0) if cfg.has_header and rows else []
        self.caption_col = self._column(cfg.caption_column, header, table)
        self.image_col = self._column(cfg.image_column, header, table)
        self.rows, self.class_names = rows, []
        self.root = Path(cfg.image_root) if cfg.image_root else table.parent
        urls = [row[self.image_col] for row in rows[:100] if len(row) > self.image_col
                and row[self.image_col].startswith(("http://", "https://"))]
        if urls:
            raise ImageURLs(f"caption table {table}: column {cfg.image_column!r} holds URLs "
                            f"({urls[0][:60]}); make-shards reads local images: download them "
                            "with img2dataset and index its output (shards.source=img2dataset)")

    @staticmethod
    def _column(spec: str, header: list[str], table: Path) -> int:
        if spec.isdigit():
            return int(spec)
        if spec not in header:
            raise ValueError(f"caption table {table}: no column {spec!r} in header {header}")
        return header.index(spec)

    def __len__(self) -> int:
        return len(self.rows)

    def load(self, i: int) -> Sample:
        row = self.rows[i]
        where = f"row {i + 1}"
        if len(row) <= max(self.caption_col, self.image_col):
            raise SkipSample("bad_row", f"{where}: {len(row)} columns")
        caption = check_caption(row[self.caption_col], where)
        if "\ufffd" in caption:
            raise SkipSample("bad_caption", f"{where}: not valid UTF-8")
        path = Path(row[self.image_col])
        path = path if path.is_absolute() else self.root / path
        if path.suffix.lower() not in IMAGE_SUFFIXES or not path.is_file():
            raise SkipSample("missing_image", f"{where}: {path}")
        data = path.read_bytes()
        check_image(data, str(path))
        return Sample(key=f"row_{i:09d}", image=data, ext=IMAGE_SUFFIXES[path.suffix.lower()],
                      caption=caption)


def build_source(cfg: ShardsConfig) -> DigitsSource | ImageFolderSource | CaptionTableSource:
    if cfg.source == "digits":
        return DigitsSource(cfg.digits_size, cfg.split)
    if cfg.source == "cluttered_digits":
        from data_pipeline.cluttered import ClutteredDigitsSource

        return ClutteredDigitsSource(cfg.samples, cfg.canvas_size, cfg.clutter, cfg.split,
                                     cfg.seed)
    if cfg.source == "imagenet":
        return ImageFolderSource(cfg.input, cfg.class_names)
    if cfg.source == "captions":
        return CaptionTableSource(cfg)
    raise ValueError(f"source {cfg.source!r} is not built sample by sample")
