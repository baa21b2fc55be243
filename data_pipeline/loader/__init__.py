"""Streaming loaders over WebDataset shards: training batches with exact resume, and
evaluation batches that read every sample once (``docs/data_pipeline.md``)."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterator
from typing import Any

from torch.utils.data import DataLoader

from data_pipeline.config import DataConfig
from data_pipeline.loader.epochs import TrainLoader, loader_options, train_batches
from data_pipeline.loader.eval import EvalStream
from data_pipeline.loader.state import LoaderState
from data_pipeline.loader.train import TrainStream
from data_pipeline.shards import ShardSet

log = logging.getLogger(__name__)


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


__all__ = ["EvalStream", "LoaderState", "TrainLoader", "TrainStream", "eval_batches",
           "loader_options", "train_batches"]
