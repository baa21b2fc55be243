"""The training stream: one rank's share of every global batch, two views per instance.

Which samples a global batch holds, and in which order, is the epoch plan's
(``data_pipeline/loader/plan.py``): chunk slots, each a slice of the epoch read in lanes
and shuffled in blocks, a function of (seed, epoch, data, global batch, chunk size) alone.
Rank r takes the chunks of its slots, whole. Its loader workers split the lanes of those
slots between them (worker w of K reads lanes w, w + K, ...), so each lane is read once,
sequentially, by one worker, and a worker holds the open shards of its own lanes only.
For every global batch each worker makes one *piece*: its lanes' samples of that batch,
decoded, their views drawn under each sample's own seed, each tagged with its slot and its
place in the chunk. It yields the pieces of K batches at a time, their views rendered
together (one message and one storage per worker for K batches, and a render as large as
a whole batch's: a message costs a file-descriptor handshake per tensor). The
DataLoader hands them over round-robin, worker 0 first, and
:class:`~data_pipeline.loader.collate.ChunkJoiner` joins the K pieces of each batch in
order (``epochs.py``). So neither the number of ranks nor the number of workers
changes a batch: only which process made it.

A sample that is skipped leaves its chunk one instance short; a rank with a chunk left
with none marks its batch a placeholder, and every rank steps over that step, so where a
stream stands never depends on what its samples held.

Resume (:class:`LoaderState`): the state records the global batches delivered under each
layout of the epoch; a lane recomputes its order and reads only from the block it stands
in. Augmentation is seeded per sample from (seed, epoch, key).
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
from data_pipeline.loader.collate import PieceDrawer
from data_pipeline.loader.plan import (
    EpochPlan,
    Layout,
    ShardOrder,
    SlotOrder,
    StreamLayout,
    Work,
)
from data_pipeline.loader.reading import ShardReader
from data_pipeline.loader.state import LoaderState
from data_pipeline.samples import RawSample, SampleChecker, Skip
from data_pipeline.shards import ShardSet
from data_pipeline.transforms import decode, decode_size

Placed = tuple[int, RawSample | Skip]  # (epoch position, the sample or why it was skipped)


def worker_slot() -> tuple[int, int]:
    """(this DataLoader worker, number of workers); (0, 1) in the main process."""
    info = get_worker_info()
    return (info.id, info.num_workers) if info else (0, 1)


class TrainStream(IterableDataset):
    """This worker's pieces of one rank's training batches from ``state`` to the end of
    the epoch. A step takes ``global_batch`` instances over all ranks (0: ``batch_size``
    on each), in chunks of ``batch_size``."""

    def __init__(self, cfg: DataConfig, shards: ShardSet, rank: int = 0, world: int = 1,
                 state: LoaderState | None = None, global_batch: int = 0) -> None:
        self.cfg, self.shards, self.rank, self.world = cfg, shards, rank, world
        self.state = state or LoaderState()
        if cfg.caption_store:  # fail at start on a broken store; workers re-open it (mmap)
            CaptionStore.open(cfg.caption_store)
        self.epochs_begun = 0  # by this copy: persistent workers count their own epochs
        per_instance = cfg.samples_per_batch // cfg.batch_size
        self.layout = Layout((global_batch or cfg.batch_size * world) * per_instance,
                             cfg.samples_per_batch)
        if world > self.layout.chunks:
            raise ValueError(f"a global batch of {self.layout.chunks} chunk(s) of "
                             f"data.batch_size={cfg.batch_size} cannot be dealt to {world} "
                             "ranks")
        self.state.enter(list(self.layout))
        self._resumed: tuple[tuple[int, str], int] | None = None  # (epoch, layouts) -> batches
        if self.layout.batches(shards.total) == 0:
            raise ValueError(f"a global batch of {self.layout.per_batch} samples exceeds the "
                             f"{shards.total} samples of {cfg.shards}")

    def plan(self, epoch: int, history: list[list[int]]) -> EpochPlan:
        """The plan of ``epoch`` after the earlier ``history`` layouts of it."""
        earlier = [(StreamLayout(*layout[:3]) if len(layout) == 4 else Layout(*layout[:2]),
                    layout[-1]) for layout in history]
        return EpochPlan(self.shards.total, self.cfg.seed, epoch, self.cfg.lanes,
                         self.cfg.shuffle_buffer, earlier, self.layout)

    @property
    def batches_per_epoch(self) -> int:
        """Global batches in the state's epoch under this layout: all of them, or after a
        change of layout mid-epoch, those of the work left."""
        if not self.state.layouts:
            return self.layout.batches(self.shards.total)
        key = (self.state.epoch, repr(self.state.layouts))
        if self._resumed is None or self._resumed[0] != key:
            self._resumed = (key, self.plan(self.state.epoch, self.state.layouts).batches)
        return self._resumed[1]

    def __len__(self) -> int:
        """Messages left: from each worker, its pieces of K batches at a time."""
        workers = max(1, self.cfg.workers)
        return -(-(self.batches_per_epoch - self.state.batches) // workers) * workers

    def position(self) -> tuple[int, int, list[list[int]]]:
        """(epoch, first batch, earlier layouts) of the epoch an iteration delivers. The
        main process reads the live state; a worker holds a copy of the state as it was
        when the workers started, so a persistent worker's later iterations are the epochs
        after it, from their first batch."""
        begun, self.epochs_begun = self.epochs_begun, self.epochs_begun + 1
        if get_worker_info() is None or begun == 0:
            return self.state.epoch, self.state.batches, self.state.layouts
        return self.state.epoch + begun, 0, []

    def __iter__(self) -> Iterator[list[dict[str, Any]]]:
        """This worker's piece of every global batch from the state's on, those of K
        batches at a time (K workers)."""
        epoch, start, history = self.position()
        worker, workers = worker_slot()
        plan = self.plan(epoch, history)
        checker = SampleChecker(len(self.shards.class_names), self.cfg.max_skip_fraction)
        reader = ShardReader(self.shards, checker, self.cfg.caption_store, self.cfg.retry,
                             self.cfg.verify_checksums)
        shards = ShardOrder(self.shards.counts, self.cfg.seed, epoch)
        lanes = [(slot, lane) for slot in self.slots
                 for lane in range(plan.slot(slot).lanes)][worker::workers]
        streams = [_Lane(slot, self.layout.chunk(slot),
                         _lane_items(plan.slot(slot), lane, start * self.layout.chunk(slot),
                                     shards, reader))
                   for slot, lane in lanes]
        draw = PieceDrawer(self.cfg, epoch)
        decoder = self._decoder()
        group: list[tuple[int, list, Any]] = []
        for batch in range(start, plan.batches):
            decoded = [(lane.slot, place, decoder(sample, checker))
                       for lane in streams for place, sample in lane.chunk(batch)]
            group.append((batch, [(slot, place, got) for slot, place, got in decoded
                                  if got is not None], checker.log.take()))
            if len(group) == workers or batch == plan.batches - 1:
                yield draw(group)
                group = []

    @property
    def slots(self) -> range:
        """The chunk slots of this rank."""
        return self.layout.slots(self.rank, self.world)

    def _decoder(self):
        """``(placed, checker) -> (sample, image) or None``: the sample decoded (the DALI
        backend: header-checked, still encoded), None where it was skipped."""
        kind = self.cfg.augment if self.cfg.pairing == "views" else "none"
        size = (decode_size(kind, self.cfg.resolution, self.cfg.crop_min_scale)
                if self.cfg.draft_decode else None)
        # the main process decodes, on its device
        encoded = backend_spec(self.cfg.backend).device_views is not None

        def decoded(sample: RawSample | Skip, checker: SampleChecker,
                    ) -> tuple[RawSample, Any] | None:
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


class _Lane:
    """One lane of a slot as a worker reads it: ``(place in chunk, sample)`` per chunk."""

    def __init__(self, slot: int, chunk: int, items: Iterator[tuple[int, Placed]]) -> None:
        self.slot, self.size, self.items = slot, chunk, items
        self.ahead: tuple[int, Placed] | None = next(items, None)

    def chunk(self, batch: int) -> Iterator[tuple[int, RawSample | Skip]]:
        first, stop = batch * self.size, (batch + 1) * self.size
        while self.ahead is not None and self.ahead[0] < stop:
            item, (_, sample) = self.ahead
            yield item - first, sample
            self.ahead = next(self.items, None)


def _lane_items(order: SlotOrder, lane: int, item: int, shards: ShardOrder,
                reader: ShardReader) -> Iterator[tuple[int, Placed]]:
    """``(slot item, placed)`` for the items of ``order`` from ``item`` on that lane
    ``lane`` holds, in order: the lane read from the block that holds its next item, each
    block delivered in its permutation."""
    if lane >= order.lanes:
        return
    first = order.lane_starts(item)[lane]
    index = first // order.block
    samples = _read(order.lane(lane, index * order.block), shards, reader)
    while index * order.block < order.lengths[lane]:
        base = index * order.block
        permutation = order.permutation(lane, index)
        got = [next(samples) for _ in permutation]
        for k in range(max(0, first - base), len(permutation)):
            yield (base + k) * order.lanes + lane, got[permutation[k]]
        index += 1


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
