"""The training stream: batches of two views per instance for one rank.

Which samples a (rank, worker) stream reads and in which order is the epoch plan's
(``data_pipeline/loader/plan.py``): every sample of the shards once per epoch across all
ranks and workers, equal batches per rank, lanes of the data set read side by side and
shuffled in blocks. Worker w of K yields the epoch's batches b with b % K == w, which the
DataLoader interleaves back into order 0, 1, 2, ... A batch is the next ``batch_size``
positions of the stream (``2 * batch_size`` for ``pairing=same_label``); a sample that is
skipped leaves its batch one instance short (a batch left with none is a placeholder the
trainer steps over on every rank), so where a stream stands never depends on
what its samples held.

Resume (:class:`LoaderState`): the state records the batches delivered under each layout
of the epoch; a stream recomputes its order and reads only the block it stands in.
Augmentation is seeded per sample from (seed, epoch, position), so the batches after the
resume point are identical to an uninterrupted run's under the same layout.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data import IterableDataset, get_worker_info

from data_pipeline.config import DataConfig
from data_pipeline.dali.params import encoded_image
from data_pipeline.formats import SkipSample
from data_pipeline.graph.store import CaptionStore
from data_pipeline.loader.backends import backend_spec
from data_pipeline.loader.collate import Instance, TrainCollator
from data_pipeline.loader.plan import EpochPlan, Layout, ShardOrder, StreamOrder, Work
from data_pipeline.loader.reading import ShardReader
from data_pipeline.loader.state import LoaderState
from data_pipeline.samples import RawSample, SampleChecker, Skip, stable_int
from data_pipeline.shards import ShardSet
from data_pipeline.text import TextConfig
from data_pipeline.transforms import decode, decode_size

Placed = tuple[int, RawSample | Skip]  # (epoch position, the sample or why it was skipped)


def worker_slot() -> tuple[int, int]:
    """(this DataLoader worker, number of workers); (0, 1) in the main process."""
    info = get_worker_info()
    return (info.id, info.num_workers) if info else (0, 1)


class TrainStream(IterableDataset):
    """One rank's training batches from ``state`` to the end of the epoch."""

    def __init__(self, cfg: DataConfig, shards: ShardSet, rank: int = 0, world: int = 1,
                 state: LoaderState | None = None, text: TextConfig | None = None,
                 global_batch: int = 0) -> None:
        self.cfg, self.shards, self.rank, self.world = cfg, shards, rank, world
        self.state, self.text = state or LoaderState(), text
        if cfg.caption_store:  # fail at start on a broken store; workers re-open it (mmap)
            CaptionStore.open(cfg.caption_store)
        self.epochs_begun = 0  # by this copy: persistent workers count their own epochs
        # ``global_batch`` instances a step over all ranks (0: batch_size on each rank)
        per_instance = cfg.samples_per_batch // cfg.batch_size
        self.layout = Layout(world, max(1, cfg.workers),
                             (global_batch or cfg.batch_size * world) * per_instance)
        self.state.enter(list(self.layout))
        self._resumed: tuple[tuple[int, str], int] | None = None  # (epoch, layouts) -> batches
        if self.layout.batches(shards.total) == 0:
            raise ValueError(f"a global batch of {self.layout.per_batch} samples exceeds the "
                             f"{shards.total} samples of {cfg.shards}")

    def plan(self, epoch: int, history: list[list[int]]) -> EpochPlan:
        """The plan of ``epoch`` after the earlier ``history`` layouts of it."""
        earlier = [(Layout(*layout[:3]), layout[3]) for layout in history]
        return EpochPlan(self.shards.total, self.cfg.seed, epoch, self.cfg.lanes,
                         self.cfg.shuffle_buffer, earlier, self.layout)

    @property
    def batches_per_epoch(self) -> int:
        """Batches per rank in the state's epoch under this layout: all of them, or after
        a change of layout mid-epoch, those of the work left."""
        if not self.state.layouts:
            return self.layout.batches(self.shards.total)
        key = (self.state.epoch, repr(self.state.layouts))
        if self._resumed is None or self._resumed[0] != key:
            self._resumed = (key, self.plan(self.state.epoch, self.state.layouts).batches)
        return self._resumed[1]

    def __len__(self) -> int:
        return self.batches_per_epoch - self.state.batches

    def position(self) -> tuple[int, int, list[list[int]]]:
        """(epoch, first batch, earlier layouts) of the epoch an iteration delivers. The
        main process reads the live state; a worker holds a copy of the state as it was
        when the workers started, so a persistent worker's later iterations are the epochs
        after it, from their first batch."""
        begun, self.epochs_begun = self.epochs_begun, self.epochs_begun + 1
        if get_worker_info() is None or begun == 0:
            return self.state.epoch, self.state.batches, self.state.layouts
        return self.state.epoch + begun, 0, []

    def __iter__(self) -> Iterator[dict[str, Any]]:
        epoch, start, history = self.position()
        worker_id, workers = worker_slot()
        # The DataLoader polls workers round-robin from worker 0, and batch `start` belongs
        # to stream start % K: worker i carries on stream (i + start) % K.
        worker = (worker_id + start) % workers
        plan = self.plan(epoch, history)
        order = plan.stream(self.rank, worker)
        checker = SampleChecker(len(self.shards.class_names), self.cfg.max_skip_fraction)
        reader = ShardReader(self.shards, checker, self.cfg.caption_store, self.cfg.retry,
                             self.cfg.verify_checksums)
        per_batch = self.layout.share(self.rank)
        done = self.layout.stream_batches(start, worker)
        placed = self._ordered(order, ShardOrder(self.shards.counts, self.cfg.seed, epoch),
                               reader, done * per_batch)
        collate = TrainCollator(self.cfg, self.text, reader.store)
        decoder = self._decoder()
        for _ in range(worker + done * workers, plan.batches, workers):
            group = self._instances([decoder(next(placed), checker) for _ in range(per_batch)])
            if not group:  # every sample skipped (or no pair): the ranks still step together
                yield collate.placeholder(checker.log.take(), bool(self.shards.class_names))
                continue
            seeds = [stable_int(self.cfg.seed, epoch, instance[0][0].key)
                     for instance in group]
            yield collate(group, seeds, checker.log.take())

    @staticmethod
    def _ordered(order: StreamOrder, shards: ShardOrder, reader: ShardReader,
                 item: int) -> Iterator[Placed]:
        """The stream's samples in its order from its item ``item`` on: each lane read
        from the block that holds ``item``, each block delivered in its permutation."""
        index = item // order.block
        starts = order.lane_starts(index * order.block)
        lanes = [_read(order.lane(lane, starts[lane]), shards, reader)
                 for lane in range(order.lanes)]
        while index * order.block < order.size:
            got = [next(lanes[lane]) for lane in order.block_lanes(index)]
            for k in order.permutation(index)[max(0, item - index * order.block):]:
                yield got[k]
            index += 1

    def _decoder(self):
        """``(placed, checker) -> (sample, image) or None``: the sample decoded (the DALI
        backend: header-checked, still encoded), None where it was skipped."""
        kind = self.cfg.augment if self.cfg.pairing == "views" else "none"
        size = (decode_size(kind, self.cfg.resolution, self.cfg.crop_min_scale)
                if self.cfg.draft_decode else None)
        # the main process decodes, on its device
        encoded = backend_spec(self.cfg.backend).device_views is not None

        def decoded(placed: Placed, checker: SampleChecker) -> tuple[RawSample, Any] | None:
            sample = placed[1]
            if isinstance(sample, Skip):  # logged with the batch that holds its position
                checker.log.add(sample)
                return None
            try:
                limit = self.cfg.max_image_pixels
                return sample, (encoded_image(sample.image, sample.shard, sample.key, limit)
                                if encoded else decode(sample.image,
                                                       f"{sample.shard}:{sample.key}", size,
                                                       limit))
            except SkipSample as skip:
                checker.skip(skip.reason, sample.shard, detail=f"{sample.key}: {skip.detail}")
                return None

        return decoded

    def _instances(self, decoded: list[tuple[RawSample, Any] | None]) -> list[Instance]:
        """One image each (``views``), or two images of one class (``same_label``: the
        first two of each class among the batch's samples, then the next two, ...)."""
        present = [d for d in decoded if d is not None]
        if self.cfg.pairing == "views":
            return [[d] for d in present]
        pending: dict[int, tuple[RawSample, Any]] = {}
        pairs: list[Instance] = []
        for sample, image in present:
            if sample.label is None:
                raise ValueError(f"data.pairing=same_label needs labels; {sample.key} in "
                                 f"{sample.shard} has none")
            if sample.label in pending:
                pairs.append([pending.pop(sample.label), (sample, image)])
            else:
                pending[sample.label] = (sample, image)
        return pairs


def _read(work: Work, shards: ShardOrder, reader: ShardReader) -> Iterator[Placed]:
    """The samples of ``work`` in order, each at its epoch position. Consecutive pieces of
    one shard at rising offsets (the sorted leftovers a resume under another layout deals
    out) are read in one pass over the shard, not one open each."""
    pieces = list(shards.pieces(work))
    i = 0
    while i < len(pieces):
        shard, first, _, base = pieces[i]
        j = i + 1
        while j < len(pieces) and pieces[j][0] == shard and pieces[j][1] >= pieces[j - 1][2]:
            j += 1
        run = pieces[i:j]
        wanted = {p for _, a, b, _ in run for p in range(a, b)} if len(run) > 1 else None
        for offset, sample in reader.read_range(shard, first, run[-1][2]):
            if wanted is None or offset in wanted:
                yield base + offset, sample
        i = j
