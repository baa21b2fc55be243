"""The training stream: batches of two views per instance for one rank.

Each (rank, worker) draws shards with replacement from ``Random(seed, epoch, rank, worker,
workers)``, reads them through a shuffle buffer, decodes and augments in the worker. An
epoch is exactly ``total_samples // (world * batch_size)`` batches on every rank whatever
the shard count, so uneven shards cannot stall DDP. Worker w of K yields the epoch's
batches b with b % K == w, which the DataLoader interleaves back into order 0, 1, 2, ...

Resume (:class:`LoaderState`): a resumed stream rebuilds each worker's stream from the
same seeds and fast-forwards through the batches already delivered without decoding or
augmenting them (a :class:`Replay`). Augmentation is seeded per instance, so the batches
after the resume point are identical to an uninterrupted run's, given the same world size,
worker count and data config.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from torch.utils.data import IterableDataset, get_worker_info

from data_pipeline.config import DataConfig
from data_pipeline.dali.params import encoded_image
from data_pipeline.formats import SkipSample
from data_pipeline.graph.store import CaptionStore
from data_pipeline.loader.collate import Instance, TrainCollator
from data_pipeline.loader.reading import ShardReader
from data_pipeline.loader.state import LoaderState
from data_pipeline.samples import RawSample, SampleChecker, stable_int
from data_pipeline.shards import ShardSet
from data_pipeline.text import TextConfig
from data_pipeline.transforms import decode, decode_size


def worker_slot() -> tuple[int, int]:
    """(this DataLoader worker, number of workers); (0, 1) in the main process."""
    info = get_worker_info()
    return (info.id, info.num_workers) if info else (0, 1)


@dataclass
class Replay:
    """Fast-forward through batches an earlier run delivered: while ``active`` nothing is
    decoded, and the known undecodable ``bad_keys`` are skipped and counted again."""

    active: bool = False
    bad_keys: set[str] = field(default_factory=set)


class TrainStream(IterableDataset):
    """One rank's training batches from ``state`` to the end of the epoch."""

    def __init__(self, cfg: DataConfig, shards: ShardSet, rank: int = 0, world: int = 1,
                 state: LoaderState | None = None, text: TextConfig | None = None) -> None:
        self.cfg, self.shards, self.rank, self.world = cfg, shards, rank, world
        self.state, self.text = state or LoaderState(), text
        if cfg.caption_store:  # fail at start on a broken store; workers re-open it (mmap)
            CaptionStore.open(cfg.caption_store)
        self.epochs_begun = 0  # by this copy: persistent workers count their own epochs
        self.batches_per_epoch = shards.total // (world * cfg.batch_size)
        if self.batches_per_epoch == 0:
            raise ValueError(f"data.batch_size={cfg.batch_size} x {world} ranks exceeds the "
                             f"{shards.total} samples of {cfg.shards}")

    def __len__(self) -> int:
        return self.batches_per_epoch - self.state.batches

    def position(self) -> tuple[int, int, list[str]]:
        """(epoch, first batch, known undecodable keys) of the epoch an iteration delivers.
        The main process reads the live state; a worker holds a copy of the state as it was
        when the workers started, so a persistent worker's later iterations are the epochs
        after it, from their first batch."""
        begun, self.epochs_begun = self.epochs_begun, self.epochs_begun + 1
        if get_worker_info() is None or begun == 0:
            return self.state.epoch, self.state.batches, self.state.bad_keys
        return self.state.epoch + begun, 0, []

    def __iter__(self) -> Iterator[dict[str, Any]]:
        epoch, start, bad_keys = self.position()
        worker_id, workers = worker_slot()
        # The DataLoader polls workers round-robin from worker 0, and batch `start` belongs
        # to stream start % K: worker i carries on stream (i + start) % K.
        worker = (worker_id + start) % workers
        rng = random.Random(stable_int(self.cfg.seed, epoch, self.rank, worker, workers))
        checker = SampleChecker(len(self.shards.class_names), self.cfg.max_skip_fraction)
        reader = ShardReader(self.shards, checker, self.cfg.caption_store, self.cfg.retry)
        replay = Replay(bad_keys=set(bad_keys))
        instances = self._instances(self._shuffled(rng, reader), checker, replay)
        collate = TrainCollator(self.cfg, self.text, reader.store)
        counter = 0
        for b in range(worker, self.batches_per_epoch, workers):
            replay.active = b < start
            group = [next(instances) for _ in range(self.cfg.batch_size)]
            seeds = [stable_int(self.cfg.seed, epoch, self.rank, worker, counter + i)
                     for i in range(len(group))]
            counter += len(group)
            skips = checker.log.take()
            if not replay.active:
                yield collate(group, seeds, skips)

    def _shuffled(self, rng: random.Random, reader: ShardReader) -> Iterator[RawSample]:
        """Resampled shards through a shuffle buffer, forever."""
        buffer: list[RawSample] = []
        while True:
            for sample in reader.read(rng.randrange(len(self.shards.urls))):
                if len(buffer) < self.cfg.shuffle_buffer:
                    buffer.append(sample)
                    continue
                slot = rng.randrange(len(buffer))
                buffer[slot], sample = sample, buffer[slot]
                yield sample

    def _instances(self, samples: Iterator[RawSample], checker: SampleChecker,
                   replay: Replay) -> Iterator[Instance]:
        """Decoded samples (the DALI backend: header-checked, still encoded) grouped into
        instances: one image (``views``) or two images of one class (``same_label``)."""
        pending: dict[int, tuple[RawSample, Any]] = {}
        kind = self.cfg.augment if self.cfg.pairing == "views" else "none"
        size = (decode_size(kind, self.cfg.resolution, self.cfg.crop_min_scale)
                if self.cfg.draft_decode else None)
        encoded = self.cfg.backend == "dali"  # the main process decodes, on its device
        for sample in samples:
            if replay.active:
                if sample.key in replay.bad_keys:  # skipped by the run being replayed
                    checker.skip("corrupt_image", sample.shard)
                    continue
                image = None
            else:
                try:
                    image = (encoded_image(sample.image, sample.shard, sample.key) if encoded
                             else decode(sample.image, f"{sample.shard}:{sample.key}", size))
                except SkipSample as skip:
                    checker.skip(skip.reason, sample.shard, bad_key=sample.key,
                                 detail=skip.detail)
                    continue
            if self.cfg.pairing == "views":
                yield [(sample, image)]
            elif sample.label is None:
                raise ValueError(f"data.pairing=same_label needs labels; {sample.key} in "
                                 f"{sample.shard} has none")
            elif sample.label in pending:
                yield [pending.pop(sample.label), (sample, image)]
            else:
                pending[sample.label] = (sample, image)
