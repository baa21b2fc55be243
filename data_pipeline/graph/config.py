"""Configuration of ``graph-precompute`` (``graph.*`` in the run config)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from core.config import InvalidValue


@dataclass
class GraphConfig:
    """``task``: ``captions`` (embed every sample's caption into a store), ``class_graph``
    (C x C cosine matrix of class-name templates), ``neighbours`` (top-k caption graph of a
    store), ``show`` (print ``key``'s caption beside its nearest captions).

    ``captions`` runs in phases ``collect`` (read this part's shards), ``encode`` (embed this
    part's share of the distinct captions), ``merge`` (write the store); ``all`` runs them
    in order, with every torchrun rank as one part. ``part``/``num_parts`` default to
    torchrun's RANK/WORLD_SIZE (a slurm array sets them explicitly per task).
    """

    task: str = "captions"  # what to build: an entry of data_pipeline/graph/tasks.py
    phase: Literal["all", "collect", "encode", "merge"] = "all"  # captions: phases to run
    shards: str = ""  # the shards whose captions (or class names) are embedded
    output: str = ""  # directory of the caption store and graphs
    model: str = "bundled"  # the bundled all-MiniLM-L6-v2, or a local model directory
    batch_size: int = 256  # captions per encoder batch
    # so the direction every caption shares (web filler, "photo") lifts no cosine
    center: bool = False  # captions: store unit(e - m), m the samples' mean (docs/graph.md)
    device: str = "auto"  # encoder device; auto: cuda when available
    part: int | None = None  # this job's part (slurm arrays); null: torchrun's RANK
    num_parts: int | None = None  # parts in all; null: torchrun's WORLD_SIZE
    class_names: str = ""  # class_graph: "" (the manifest's), "imagenet1k", or a file
    templates: list[str] = field(default_factory=lambda: ["a photo of a {name}."])  # class_graph
    neighbours: int = 10  # neighbours: k nearest captions kept per caption
    index: Literal["auto", "exact", "ivf"] = "auto"  # neighbours: search; auto: exact if small
    key: str = ""  # show: the sample to inspect

    def validate(self) -> None:
        if self.batch_size < 1:
            raise InvalidValue("batch_size", f"must be >= 1, got {self.batch_size}")
        if self.neighbours < 1:
            raise InvalidValue("neighbours", f"must be >= 1, got {self.neighbours}")
        if not self.templates or any("{name}" not in t for t in self.templates):
            raise InvalidValue("templates", "each template needs a {name} placeholder")
        if self.num_parts is not None and not 0 <= (self.part or 0) < self.num_parts:
            raise InvalidValue("part", f"must lie in [0, {self.num_parts}), got {self.part}")
