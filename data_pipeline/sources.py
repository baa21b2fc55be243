"""The table of make-shards sources: each entry builds the source that maps an index to
one encoded sample, and declares what it needs from ``shards.*``.

A source is cheap to build and pickle (paths or small arrays); ``load(i)`` does the I/O in a
worker process and raises :class:`SkipSample` with a reason for bad input, which is then
counted rather than written. Adding a source is its module, an entry here, its test and a
line in ``docs/data_pipeline.md``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from core.config import InvalidValue
from core.tables import table_entry
from data_pipeline.caption_table import CaptionTableSource
from data_pipeline.cluttered import ClutteredDigitsSource
from data_pipeline.config import ShardsConfig
from data_pipeline.digits import DigitsSource
from data_pipeline.image_tree import ImageFolderSource

SPLITS = ("all", "train", "test")


@dataclass(frozen=True)
class SourceSpec:
    """A source of samples and what it needs."""

    # ShardsConfig -> the source, sample by sample; None: shards indexed where they lie
    build: Callable[[ShardsConfig], Any] | None
    needs_input: bool = True  # shards.input names its data (a tree, a table, tar shards)
    splits: tuple[str, ...] = SPLITS  # the shards.split values it draws
    about_splits: str = ""  # why some splits are not among them


SOURCES: dict[str, SourceSpec] = {
    "digits": SourceSpec(lambda cfg: DigitsSource(cfg.digits_size, cfg.split),
                         needs_input=False),
    "cluttered_digits": SourceSpec(
        lambda cfg: ClutteredDigitsSource(cfg.samples, cfg.canvas_size, cfg.clutter,
                                          cfg.split, cfg.seed, cfg.captions),
        needs_input=False, splits=("train", "test"),
        about_splits="it draws train or test canvases from disjoint digits"),
    "imagenet": SourceSpec(lambda cfg: ImageFolderSource(cfg.input, cfg.class_names,
                                                         cfg.max_image_pixels)),
    "captions": SourceSpec(CaptionTableSource),
    "img2dataset": SourceSpec(None),  # validated and indexed in place
}


def source_spec(name: str) -> SourceSpec:
    """The entry of source ``name``; :class:`InvalidValue` for ``source`` naming the
    choices, if there is none."""
    return table_entry(SOURCES, name, "source", "source")


def check_source(cfg: ShardsConfig) -> None:
    """``shards.*`` gives the configured source what its entry says it needs."""
    spec = source_spec(cfg.source)
    if spec.needs_input and not cfg.input:
        raise InvalidValue("input", f"source {cfg.source!r} needs an input path")
    if cfg.split not in spec.splits:
        raise InvalidValue("split", f"source {cfg.source!r} takes split "
                                    f"{' or '.join(spec.splits)}: {spec.about_splits}")


def build_source(cfg: ShardsConfig) -> Any:
    """The configured source (sample by sample; not one indexed in place)."""
    build = source_spec(cfg.source).build
    if build is None:
        raise ValueError(f"source {cfg.source!r} is not built sample by sample")
    return build(cfg)
