"""Sample sources for make-shards: each maps an index to one encoded sample.

A source is cheap to build and pickle (paths or small arrays); ``load(i)`` does the I/O in a
worker process and raises :class:`SkipSample` with a reason for bad input, which is then
counted rather than written.
"""

from __future__ import annotations

from data_pipeline.caption_table import CaptionTableSource
from data_pipeline.cluttered import ClutteredDigitsSource
from data_pipeline.config import ShardsConfig
from data_pipeline.digits import DigitsSource
from data_pipeline.image_tree import ImageFolderSource


def build_source(cfg: ShardsConfig) -> DigitsSource | ImageFolderSource | CaptionTableSource:
    if cfg.source == "digits":
        return DigitsSource(cfg.digits_size, cfg.split)
    if cfg.source == "cluttered_digits":
        return ClutteredDigitsSource(cfg.samples, cfg.canvas_size, cfg.clutter, cfg.split,
                                     cfg.seed)
    if cfg.source == "imagenet":
        return ImageFolderSource(cfg.input, cfg.class_names, cfg.max_image_pixels)
    if cfg.source == "captions":
        return CaptionTableSource(cfg)
    raise ValueError(f"source {cfg.source!r} is not built sample by sample")
