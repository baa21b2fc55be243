"""Configuration of the data stages: ``shards.*`` (make-shards) and ``data.*`` (loaders)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pretrain.config import InvalidValue

Source = Literal["digits", "imagenet", "captions", "img2dataset"]


@dataclass
class ShardsConfig:
    """Where samples come from and how they are cut into WebDataset shards.

    ``source``: ``digits`` (bundled scikit-learn digits), ``imagenet`` (``input`` is a tree
    ``<input>/<class_dir>/*.JPEG``), ``captions`` (``input`` is a CSV/TSV table of caption and
    local image path; CC3M and CC12M order the columns differently, so name or number them),
    ``img2dataset`` (``input`` holds img2dataset's tar shards: validated and indexed in place).
    """

    source: Source = "digits"
    input: str = ""
    output: str = "data/shards/digits"
    class_names: str = ""  # file with one name per line, or "imagenet1k" (torchvision's list)
    caption_column: str = "caption"  # a header name, or a 0-based column number as text
    image_column: str = "image"
    delimiter: str | None = None  # None: tab for .tsv, comma otherwise
    has_header: bool = True
    image_root: str = ""  # relative image paths in a table are resolved against this
    shard_size: int = 1000
    workers: int = 2
    digits_size: int = 64  # digits are upsampled from 8x8 to this many pixels
    split: Literal["all", "train", "test"] = "all"  # digits: every 5th image is test

    def validate(self) -> None:
        if self.shard_size < 1:
            raise InvalidValue("shard_size", f"must be >= 1, got {self.shard_size}")
        if self.workers < 1:
            raise InvalidValue("workers", f"must be >= 1, got {self.workers}")
        if self.source != "digits" and not self.input:
            raise InvalidValue("input", f"source {self.source!r} needs an input path")
        if self.digits_size < 8:
            raise InvalidValue("digits_size", f"must be >= 8, got {self.digits_size}")


@dataclass
class DataConfig:
    """The training and evaluation loaders (``data.*``)."""

    shards: str = "data/shards/digits"  # a directory holding manifest.json and the shards
    batch_size: int = 64  # images per rank per step; each yields two views
    workers: int = 2
    resolution: int = 32
    augment: Literal["simclr", "autoaugment", "none"] = "simclr"
    pairing: Literal["views", "same_label"] = "views"
    crop_min_scale: float = 0.2
    shuffle_buffer: int = 512
    seed: int = 0
    max_skip_fraction: float = 0.01
    verify_checksums: bool = False
    caption_store: str = ""  # graph-precompute output: joins caption embeddings by key
    tokenizer: str = ""  # clip: tokenise captions in the workers ("bundled" or a model dir)
    text_length: int = 32  # tokens per caption

    def validate(self) -> None:
        for key in ("batch_size", "resolution"):
            if getattr(self, key) < 1:
                raise InvalidValue(key, f"must be >= 1, got {getattr(self, key)}")
        if self.workers < 0:
            raise InvalidValue("workers", f"must be >= 0, got {self.workers}")
        if not 0 <= self.max_skip_fraction <= 1:
            raise InvalidValue("max_skip_fraction",
                               f"must lie in [0, 1], got {self.max_skip_fraction}")
        if not 0 < self.crop_min_scale <= 1:
            raise InvalidValue("crop_min_scale", f"must lie in (0, 1], got {self.crop_min_scale}")
