"""Streaming loaders over WebDataset shards: training batches with exact resume, and
evaluation batches that read every sample once (``docs/data_pipeline.md``)."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader

from data_pipeline.config import DataConfig
from data_pipeline.loader.eval import EvalStream
from data_pipeline.loader.state import LoaderState
from data_pipeline.loader.train import TrainStream
from data_pipeline.shards import ShardSet
from data_pipeline.text import TextConfig

log = logging.getLogger(__name__)


def loader_options(cfg: DataConfig) -> dict[str, Any]:
    """Worker count, prefetch depth and pinned host memory (when a GPU will copy it)."""
    options: dict[str, Any] = {"num_workers": cfg.workers,
                               "pin_memory": cfg.pin_memory and torch.cuda.is_available()}
    if cfg.workers > 0:
        options["prefetch_factor"] = cfg.prefetch
    return options


def train_batches(cfg: DataConfig, rank: int = 0, world: int = 1,
                  state: LoaderState | None = None,
                  text: TextConfig | None = None) -> Iterator[dict[str, Any]]:
    """One epoch of training batches from ``state`` on (updating it as batches arrive).

    ``text``: tokenise each instance's caption with this sentence model (CLIP).
    """
    state = state or LoaderState()
    shards = ShardSet.open(cfg.shards, cfg.verify_checksums, cfg.retry)
    stream = TrainStream(cfg, shards, rank, world, state, text)
    loader = DataLoader(stream, batch_size=None, **loader_options(cfg))
    epoch_skips: Counter = Counter()
    for batch in loader:
        state.record(batch)
        epoch_skips.update(batch["skipped"])
        yield batch
    if epoch_skips:
        log.warning("data: epoch %d skipped %s (totals so far %s)", state.epoch,
                    dict(epoch_skips), state.skipped)
    state.next_epoch()


def eval_batches(cfg: DataConfig, rank: int = 0, world: int = 1,
                 skipped: Counter | None = None) -> Iterator[dict[str, Any]]:
    """Evaluation batches of this rank; per-reason skips are added to ``skipped``."""
    shards = ShardSet.open(cfg.shards, cfg.verify_checksums, cfg.retry)
    stream = EvalStream(cfg, shards, rank, world)
    seen: Counter = Counter()
    for batch in DataLoader(stream, batch_size=None, **loader_options(cfg)):
        seen.update(batch["skipped"])
        if batch["keys"]:
            yield batch
    if skipped is not None:
        skipped.update(seen)
    if seen:
        log.warning("data: evaluation of %s skipped %s", cfg.shards, dict(seen))


__all__ = ["EvalStream", "LoaderState", "TrainStream", "eval_batches", "train_batches"]
