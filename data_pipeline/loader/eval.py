"""The evaluation stream: every sample once across ranks and workers.

Shard i goes to global worker i % (world * workers), so every sample is read exactly once,
with no padding; batches are (images, keys, labels).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import IterableDataset

from data_pipeline.config import DataConfig
from data_pipeline.formats import SkipSample
from data_pipeline.graph.store import CaptionStore
from data_pipeline.loader.reading import ShardReader
from data_pipeline.loader.train import worker_slot
from data_pipeline.samples import RawSample, SampleChecker, SkipLog
from data_pipeline.shards import ShardSet
from data_pipeline.transforms import DecodeSize, decode, eval_view


class EvalStream(IterableDataset):
    def __init__(self, cfg: DataConfig, shards: ShardSet, rank: int = 0, world: int = 1,
                 ) -> None:
        self.cfg, self.shards, self.rank, self.world = cfg, shards, rank, world
        if cfg.caption_store:
            CaptionStore.open(cfg.caption_store)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        worker, workers = worker_slot()
        slot, slots = self.rank * workers + worker, self.world * workers
        checker = SampleChecker(len(self.shards.class_names), self.cfg.max_skip_fraction)
        reader = ShardReader(self.shards, checker, self.cfg.caption_store, self.cfg.retry,
                             self.cfg.verify_checksums)
        view = eval_view(self.cfg.resolution)
        size = DecodeSize(self.cfg.resolution) if self.cfg.draft_decode else None
        images, samples = [], []
        for index in range(slot, len(self.shards.urls), slots):
            for sample in reader.read(index):
                try:
                    images.append(view(decode(sample.image, f"{sample.shard}:{sample.key}",
                                              size, self.cfg.max_image_pixels)))
                except SkipSample as skip:
                    checker.skip(skip.reason, sample.shard, detail=skip.detail)
                    continue
                samples.append(sample)
                if len(samples) == self.cfg.batch_size:
                    yield self._batch(images, samples, checker.log.take())
                    images, samples = [], []
        if samples or checker.log.counts:
            yield self._batch(images, samples, checker.log.take())

    @staticmethod
    def _batch(images: list, samples: list[RawSample], skips: SkipLog) -> dict[str, Any]:
        return {
            "images": torch.stack(images) if images else torch.empty(0),
            "keys": [s.key for s in samples],
            "labels": torch.tensor([-1 if s.label is None else s.label for s in samples]),
            "captions": [s.caption for s in samples],  # str, or None without a caption
            **skips.as_batch(),
        }
