"""Streaming loaders over WebDataset shards (SPEC section 2; issue #3).

Training (:class:`TrainStream`): each (rank, worker) draws shards with replacement from
``Random(seed, epoch, rank, worker, workers)``, reads them through a shuffle buffer, decodes
and augments in the worker. An epoch is exactly ``total_samples // (world * batch_size)``
batches on every rank whatever the shard count, so uneven shards cannot stall DDP. Worker
w of K yields the epoch's batches b with b % K == w, which the DataLoader interleaves back
into order 0, 1, 2, ...

Resume semantics (:class:`LoaderState`, saved in checkpoints): ``epoch`` and ``batches``
(batches delivered in that epoch) say where to continue. A resumed loader rebuilds each
worker's stream from the same seeds and fast-forwards through the batches already
delivered without decoding or augmenting them; undecodable samples met so far are listed
in ``bad_keys`` so the replay skips exactly what the first run skipped. Augmentation is
seeded per instance, so the batches after the resume point are identical to an
uninterrupted run's, given the same world size, worker count and data config.

Evaluation (:class:`EvalStream`): shard i goes to global worker i % (world * workers), so
every sample is read exactly once across ranks and workers, with no padding.
"""

from __future__ import annotations

import logging
import random
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from data_pipeline.config import DataConfig
from data_pipeline.graph.store import CaptionStore
from data_pipeline.samples import RawSample, SampleChecker, ShardSet, SkipLog, stable_int
from data_pipeline.sources import SkipSample
from data_pipeline.tario import TruncatedShard, iter_shard
from data_pipeline.transforms import decode, eval_view, view_transform

log = logging.getLogger(__name__)


@dataclass
class LoaderState:
    """Where the training stream stands; saved in and restored from checkpoints."""

    epoch: int = 0
    batches: int = 0  # batches delivered in this epoch
    bad_keys: list[str] = field(default_factory=list)  # undecodable samples this epoch
    skipped: dict[str, int] = field(default_factory=dict)  # all epochs, per reason

    def record(self, batch: dict[str, Any]) -> None:
        self.batches += 1
        self.bad_keys.extend(batch["skipped_keys"])
        for reason, count in batch["skipped"].items():
            self.skipped[reason] = self.skipped.get(reason, 0) + count

    def next_epoch(self) -> None:
        self.epoch, self.batches, self.bad_keys = self.epoch + 1, 0, []

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> LoaderState:
        return cls(**state)


def _worker() -> tuple[int, int]:
    info = get_worker_info()
    return (info.id, info.num_workers) if info else (0, 1)


class _Stream(IterableDataset):
    def __init__(self, cfg: DataConfig, shards: ShardSet, rank: int, world: int) -> None:
        self.cfg, self.shards, self.rank, self.world = cfg, shards, rank, world
        self.store: CaptionStore | None = None
        self.tokenizer = None
        if cfg.caption_store:  # fail at start on a broken store; workers re-open (mmap)
            CaptionStore.open(cfg.caption_store)

    def _open_store(self) -> None:
        if self.cfg.caption_store and self.store is None:
            self.store = CaptionStore.open(self.cfg.caption_store)

    def _read(self, index: int, checker: SampleChecker,
              log: list[SkipLog]) -> Iterator[RawSample]:
        """Valid-looking samples of shard ``index``; skips are logged in ``log[0]``."""
        path = self.shards.paths[index]
        try:
            for raw in iter_shard(path):
                try:
                    sample = checker.parse(raw, path.name)
                    if self.store is not None:
                        rows, found = self.store.find([sample.key])
                        if not found[0]:
                            raise SkipSample("missing_embedding", sample.key)
                        sample.row = int(rows[0])
                    yield sample
                except SkipSample as skip:
                    checker.skip(log[0], skip.reason, path.name)
        except TruncatedShard:
            checker.skip(log[0], "truncated_shard", path.name)


class TrainStream(_Stream):
    """Batches of two views per instance for one rank; see the module docstring."""

    def __init__(self, cfg: DataConfig, shards: ShardSet, rank: int = 0, world: int = 1,
                 state: LoaderState | None = None) -> None:
        super().__init__(cfg, shards, rank, world)
        self.state = state or LoaderState()
        self.batches_per_epoch = shards.total // (world * cfg.batch_size)
        if self.batches_per_epoch == 0:
            raise ValueError(f"data.batch_size={cfg.batch_size} x {world} ranks exceeds the "
                             f"{shards.total} samples of {cfg.shards}")

    def __len__(self) -> int:
        return self.batches_per_epoch - self.state.batches

    def __iter__(self) -> Iterator[dict[str, Any]]:
        self._open_store()
        epoch, start = self.state.epoch, self.state.batches
        worker_id, workers = _worker()
        # The DataLoader polls workers round-robin from worker 0, and batch `start` belongs
        # to stream start % K: worker i carries on stream (i + start) % K.
        worker = (worker_id + start) % workers
        rng = random.Random(stable_int(self.cfg.seed, epoch, self.rank, worker, workers))
        checker = SampleChecker(len(self.shards.class_names), self.cfg.max_skip_fraction)
        log = [SkipLog()]
        bad = set(self.state.bad_keys)
        replaying = [True]
        instances = self._instances(self._shuffled(rng, checker, log), checker, log, bad,
                                    replaying)
        augment = view_transform(self.cfg.augment, self.cfg.resolution, self.cfg.crop_min_scale)
        plain = eval_view(self.cfg.resolution)
        counter = 0
        for b in range(worker, self.batches_per_epoch, workers):
            replaying[0] = b < start
            group = [next(instances) for _ in range(self.cfg.batch_size)]
            seeds = [stable_int(self.cfg.seed, epoch, self.rank, worker, counter + i)
                     for i in range(len(group))]
            counter += len(group)
            if replaying[0]:
                log[0] = SkipLog()
                continue
            yield self._collate(group, seeds, augment, plain, log[0])
            log[0] = SkipLog()

    def _shuffled(self, rng: random.Random, checker: SampleChecker,
                  log: list[SkipLog]) -> Iterator[RawSample]:
        """Resampled shards through a shuffle buffer, forever."""
        buffer: list[RawSample] = []
        while True:
            index = rng.randrange(len(self.shards.paths))
            for sample in self._read(index, checker, log):
                if len(buffer) < self.cfg.shuffle_buffer:
                    buffer.append(sample)
                    continue
                slot = rng.randrange(len(buffer))
                buffer[slot], sample = sample, buffer[slot]
                yield sample

    def _instances(self, samples: Iterator[RawSample], checker: SampleChecker,
                   log: list[SkipLog], bad: set[str],
                   replaying: list[bool]) -> Iterator[list[tuple[RawSample, Any]]]:
        """Decoded samples grouped into instances: one image (``views``) or two images of
        one class (``same_label``). While replaying, images are not decoded; known
        undecodable keys are skipped instead."""
        pending: dict[int, tuple[RawSample, Any]] = {}
        for sample in samples:
            if replaying[0]:
                if sample.key in bad:  # skipped (and counted) by the run being replayed
                    checker.skip(log[0], "corrupt_image", sample.shard)
                    continue
                image = None
            else:
                try:
                    image = decode(sample.image, f"{sample.shard}:{sample.key}")
                except SkipSample as skip:
                    log[0].bad_keys.append(sample.key)
                    checker.skip(log[0], skip.reason, sample.shard)
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

    def _collate(self, group: list[list[tuple[RawSample, Any]]], seeds: list[int],
                 augment: Any, plain: Any, log: SkipLog) -> dict[str, Any]:
        first, second = [], []
        for instance, seed in zip(group, seeds, strict=True):
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                if len(instance) == 1:
                    image = instance[0][1]
                    first.append(augment(image))
                    second.append(augment(image))
                else:
                    first.append(plain(instance[0][1]))
                    second.append(plain(instance[1][1]))
        heads = [instance[0][0] for instance in group]
        ids = torch.tensor([stable_int(s.key) for s in heads])
        batch = {
            "images": torch.stack(first + second),  # [2B, 3, R, R]: view 1 rows, then view 2
            "ids": ids.repeat(2),
            "keys": ["+".join(s.key for s, _ in instance) for instance in group],
            "captions": [s.caption for s in heads],
            "skipped": dict(log.counts),
            "skipped_keys": list(log.bad_keys),
        }
        if heads[0].label is not None:
            batch["labels"] = torch.tensor([s.label for s in heads]).repeat(2)
        if self.cfg.tokenizer:  # [2B, L] token ids and mask, the views share the caption
            batch.update({k: v.repeat(2, 1) for k, v in self._tokens(heads).items()})
        if self.store is not None:  # [2B, E] float16, the views share their caption's row
            rows = [s.row for s in heads]
            batch["caption_embeddings"] = torch.from_numpy(
                np.asarray(self.store.embeddings[rows])).repeat(2, 1)
        return batch


    def _tokens(self, heads: list[RawSample]) -> dict[str, torch.Tensor]:
        from pretrain.text_tower import load_tokenizer, tokenize

        if self.tokenizer is None:
            self.tokenizer = load_tokenizer(self.cfg.tokenizer)
        for sample in heads:
            if sample.caption is None:
                raise ValueError(f"data.tokenizer is set (clip) but {sample.key} in "
                                 f"{sample.shard} has no caption")
        return tokenize(self.tokenizer, [s.caption for s in heads], self.cfg.text_length)


class EvalStream(_Stream):
    """Every sample once across ranks and workers: (images, keys, labels) batches."""

    def __iter__(self) -> Iterator[dict[str, Any]]:
        self._open_store()
        worker, workers = _worker()
        slot, slots = self.rank * workers + worker, self.world * workers
        checker = SampleChecker(len(self.shards.class_names), self.cfg.max_skip_fraction)
        log = [SkipLog()]
        view = eval_view(self.cfg.resolution)
        images, samples = [], []
        for index in range(slot, len(self.shards.paths), slots):
            for sample in self._read(index, checker, log):
                try:
                    images.append(view(decode(sample.image, f"{sample.shard}:{sample.key}")))
                except SkipSample as skip:
                    checker.skip(log[0], skip.reason, sample.shard)
                    continue
                samples.append(sample)
                if len(samples) == self.cfg.batch_size:
                    yield self._batch(images, samples, log)
                    images, samples, log[0] = [], [], SkipLog()
        if samples or log[0].counts:
            yield self._batch(images, samples, log)

    @staticmethod
    def _batch(images: list, samples: list[RawSample], log: list[SkipLog]) -> dict[str, Any]:
        return {
            "images": torch.stack(images) if images else torch.empty(0),
            "keys": [s.key for s in samples],
            "labels": torch.tensor([-1 if s.label is None else s.label for s in samples]),
            "skipped": dict(log[0].counts),
        }


def train_batches(cfg: DataConfig, rank: int = 0, world: int = 1,
                  state: LoaderState | None = None) -> Iterator[dict[str, Any]]:
    """One epoch of training batches from ``state`` on (updating it as batches arrive)."""
    state = state or LoaderState()
    stream = TrainStream(cfg, ShardSet.open(cfg.shards, cfg.verify_checksums), rank, world,
                         state)
    loader = DataLoader(stream, batch_size=None, num_workers=cfg.workers,
                        persistent_workers=False)
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
    stream = EvalStream(cfg, ShardSet.open(cfg.shards, cfg.verify_checksums), rank, world)
    seen: Counter = Counter()
    for batch in DataLoader(stream, batch_size=None, num_workers=cfg.workers):
        seen.update(batch["skipped"])
        if batch["keys"]:
            yield batch
    if skipped is not None:
        skipped.update(seen)
    if seen:
        log.warning("data: evaluation of %s skipped %s", cfg.shards, dict(seen))
