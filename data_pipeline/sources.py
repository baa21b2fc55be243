"""Sample sources for make-shards: each maps an index to one encoded sample.

A source is cheap to build and pickle (paths or small arrays); ``load(i)`` does the I/O in a
worker process and raises :class:`SkipSample` with a reason for bad input, which is then
counted rather than written.
"""

from __future__ import annotations

import re
from pathlib import Path

from data_pipeline.caption_table import CaptionTableSource
from data_pipeline.cluttered import ClutteredDigitsSource
from data_pipeline.config import ShardsConfig
from data_pipeline.digits import DigitsSource
from data_pipeline.formats import IMAGE_SUFFIXES, Sample
from data_pipeline.samples import check_image


def safe_key(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_\-]", "_", text)


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


def build_source(cfg: ShardsConfig) -> DigitsSource | ImageFolderSource | CaptionTableSource:
    if cfg.source == "digits":
        return DigitsSource(cfg.digits_size, cfg.split)
    if cfg.source == "cluttered_digits":
        return ClutteredDigitsSource(cfg.samples, cfg.canvas_size, cfg.clutter, cfg.split,
                                     cfg.seed)
    if cfg.source == "imagenet":
        return ImageFolderSource(cfg.input, cfg.class_names)
    if cfg.source == "captions":
        return CaptionTableSource(cfg)
    raise ValueError(f"source {cfg.source!r} is not built sample by sample")
