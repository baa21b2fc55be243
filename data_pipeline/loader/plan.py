"""The epoch plan: which samples each global batch holds, and in which order.

Positions. An epoch lays the data set out as one sequence: the shards in an order drawn
from (seed, epoch) alone, each shard's samples in file order. Position p is sample
``p - start[s]`` of the shard s whose span holds p. Work is a list of ``[a, b)`` position
ranges.

Layout. ``(per_batch, per_chunk)``: a step takes ``per_batch`` positions (the global
batch) in ``C = ceil(per_batch / per_chunk)`` chunks of ``per_chunk`` (the last takes the
rest). An epoch has ``T = work // per_batch`` global batches. Chunk slot c owns a
consecutive slice of the work, ``T * n_c`` positions (slot-major), and chunk c of global
batch b is items ``[b * n_c, (b + 1) * n_c)`` of the slot's order. The last ``work - T *
per_batch`` positions (less than one global batch) wait for the next epoch's order. None
of this depends on the number of ranks or loader workers: rank r of W takes the slots
:meth:`Layout.slots` gives it, whole, and its workers split the slots' lanes
(``train.py``), so global batch b holds the same samples in the same order on any world.

Slot order (:class:`SlotOrder`). A slot cuts its slice into ``lanes`` consecutive parts;
each lane is shuffled in blocks of ``block / lanes`` items, each block by its own
permutation seeded by (seed, epoch, layout number, slot, lane), and the slot reads the
lanes side by side: its item t is item ``t // lanes`` of lane ``t % lanes`` (so a chunk
mixes ``lanes`` places of the data set, an equal share from each). Where a slot stands is
one number, the items it has delivered, and a lane resumes by reading from the block that
holds its next item (:meth:`SlotOrder.lane_starts`).

Another layout mid-epoch (another global batch or chunk size: ``data.global_batch=
per_rank`` on another world, or another ``data.batch_size``): the work left is every
slot's :meth:`SlotOrder.remainder` (the undelivered items of its lanes' current blocks,
then the rest of its lanes) followed by the undealt tail, and it is dealt again under the new
layout. Nothing is lost or read twice. A state saved before chunk slots names the
(rank, worker) streams that delivered its batches (:class:`StreamLayout`); their
remainders are found the same way.
"""

from __future__ import annotations

import bisect
import itertools
import random
from collections.abc import Iterator
from itertools import accumulate
from typing import NamedTuple

from data_pipeline.samples import stable_int

Range = tuple[int, int]  # [a, b) of epoch positions


class Layout(NamedTuple):
    """How an epoch is cut: a step takes ``per_batch`` positions (the global batch), in
    chunks of ``per_chunk`` (a rank's configured batch; the last chunk takes the rest)."""

    per_batch: int
    per_chunk: int

    @property
    def chunks(self) -> int:
        return -(-self.per_batch // self.per_chunk)

    def chunk(self, slot: int) -> int:
        """Positions chunk ``slot`` of a global batch takes."""
        return min(self.per_chunk, self.per_batch - slot * self.per_chunk)

    def batches(self, work: int) -> int:
        """Global batches in ``work`` positions."""
        return work // self.per_batch

    def slots(self, rank: int, world: int) -> range:
        """The chunk slots rank ``rank`` of ``world`` takes: consecutive, as many on every
        rank but one more on the first ``chunks % world``."""
        base, extra = divmod(self.chunks, world)
        first = rank * base + min(rank, extra)
        return range(first, first + base + (rank < extra))


class StreamLayout(NamedTuple):
    """The layout of states saved before chunk slots: ``per_batch`` positions a step over
    ``world`` ranks of ``workers`` streams each (read to continue such an epoch)."""

    world: int
    workers: int
    per_batch: int

    def share(self, rank: int) -> int:
        return self.per_batch // self.world + (rank < self.per_batch % self.world)

    def stream_batches(self, batches: int, worker: int) -> int:
        return len(range(worker, batches, self.workers))


class ShardOrder:
    """The epoch's shard order and where each shard's samples lie in the position
    sequence. Depends on (seed, epoch) and the shard counts only."""

    def __init__(self, counts: list[int], seed: int, epoch: int) -> None:
        self.order = list(range(len(counts)))
        random.Random(stable_int("shards", seed, epoch)).shuffle(self.order)
        self.starts = [0, *accumulate(counts[s] for s in self.order)]
        self.total = self.starts[-1]

    def pieces(self, work: Work) -> Iterator[tuple[int, int, int, int]]:
        """``(shard, first, stop, base)`` sample ranges of shards covering ``work``, in
        order; ``base`` is the position of the shard's sample 0."""
        for a, b in work.ranges:
            while a < b:
                k = bisect.bisect_right(self.starts, a) - 1
                end = min(b, self.starts[k + 1])
                base = self.starts[k]
                yield self.order[k], a - base, end - base, base
                a = end


class Work:
    """A sequence of positions, held as ``[a, b)`` ranges with their cumulative sizes so
    that cutting it costs O(log ranges + ranges cut)."""

    def __init__(self, ranges: list[Range]) -> None:
        self.ranges = [(a, b) for a, b in ranges if b > a]
        self.ends = list(accumulate(b - a for a, b in self.ranges))
        self.size = self.ends[-1] if self.ends else 0

    def cut(self, lo: int, hi: int) -> Work:
        """Items [lo, hi) of the sequence."""
        hi = min(hi, self.size)
        out: list[Range] = []
        k = bisect.bisect_right(self.ends, lo)
        while lo < hi:
            a, b = self.ranges[k]
            begin = self.ends[k] - (b - a)
            take = min(hi, self.ends[k]) - lo
            out.append((a + lo - begin, a + lo - begin + take))
            lo += take
            k += 1
        return Work(out)

    def at(self, item: int) -> int:
        """The position of item ``item``."""
        k = bisect.bisect_right(self.ends, item)
        a, b = self.ranges[k]
        return a + item - (self.ends[k] - (b - a))


def merged(positions: list[int]) -> list[Range]:
    """Sorted positions as ranges."""
    out: list[Range] = []
    for p in sorted(positions):
        if out and out[-1][1] == p:
            out[-1] = (out[-1][0], p + 1)
        else:
            out.append((p, p + 1))
    return out


class Lanes:
    """A slice ``work`` cut into ``lanes`` consecutive lanes (the first ``size % lanes`` one
    item longer), read side by side: item t is item ``t // lanes`` of lane ``t % lanes``."""

    def __init__(self, work: Work, lanes: int, seed: int) -> None:
        self.work, self.seed = work, seed
        self.size = work.size
        self.lanes = max(1, min(lanes, self.size))
        base, extra = divmod(self.size, self.lanes)
        self.lengths = [base + (lane < extra) for lane in range(self.lanes)]
        self.starts = [0, *accumulate(self.lengths)]

    def lane(self, lane: int, first: int = 0) -> Work:
        """The work of ``lane`` from its item ``first`` on."""
        return self.work.cut(self.starts[lane] + first, self.starts[lane + 1])

    def lane_starts(self, item: int) -> list[int]:
        """Per lane, how many of its items come before item ``item``."""
        return [(item - lane + self.lanes - 1) // self.lanes if item > lane else 0
                for lane in range(self.lanes)]


class StreamOrder(Lanes):
    """The order of one (rank, worker) stream's slice ``work`` in states saved before chunk
    slots (:class:`StreamLayout`): its lanes' items shuffled together in blocks."""

    def __init__(self, work: Work, lanes: int, block: int, seed: int) -> None:
        super().__init__(work, lanes, seed)
        self.block = block

    def permutation(self, index: int) -> list[int]:
        """The order in which block ``index`` delivers its pre-order items."""
        n = min(self.block, self.size - index * self.block)
        order = list(range(n))
        random.Random(stable_int(self.seed, index)).shuffle(order)
        return order

    def slice_position(self, item: int) -> int:
        """Where pre-order ``item`` lies in the slice."""
        return self.starts[item % self.lanes] + item // self.lanes

    def positions(self, start: int = 0) -> Iterator[int]:
        """The epoch positions this stream delivers, from its item ``start`` on (no data
        read: for plans, tests and benchmarks)."""
        for index in range(start // self.block, -(-self.size // self.block)):
            base = index * self.block
            for k in self.permutation(index)[max(0, start - base):]:
                yield self.work.at(self.slice_position(base + k))

    def remainder(self, delivered: int) -> list[Range]:
        """The work this stream has not delivered after ``delivered`` items: the rest of
        its current block (sorted), then the rest of every lane."""
        if delivered >= self.size:
            return []
        index = delivered // self.block
        base = index * self.block
        rest = [self.slice_position(base + k)
                for k in self.permutation(index)[delivered - base:]]
        left = [self.work.at(at) for at in rest]
        after = self.lane_starts(min(base + self.block, self.size))
        lanes = [r for lane in range(self.lanes) for r in self.lane(lane, after[lane]).ranges]
        return merged(left) + lanes


class SlotOrder(Lanes):
    """The order of one chunk slot's slice ``work``: its lanes, each shuffled in blocks of
    ``block // lanes`` items by permutations of its own, read side by side (item t of the
    slot is item ``t // lanes`` of lane ``t % lanes``'s shuffled order). Any run of n items
    takes n / lanes from every lane, to one, so the workers that share a slot's lanes get
    equal shares of every chunk."""

    def __init__(self, work: Work, lanes: int, block: int, seed: int) -> None:
        super().__init__(work, lanes, seed)
        self.block = max(1, block // self.lanes)  # a lane's block

    def permutation(self, lane: int, index: int) -> list[int]:
        """The order in which block ``index`` of ``lane`` delivers its items."""
        n = min(self.block, self.lengths[lane] - index * self.block)
        order = list(range(n))
        random.Random(stable_int(self.seed, lane, index)).shuffle(order)
        return order

    def lane_order(self, lane: int, first: int = 0) -> Iterator[int]:
        """The items of ``lane`` in its shuffled order, from its ``first``-th on."""
        for index in range(first // self.block, -(-self.lengths[lane] // self.block)):
            base = index * self.block
            for k in self.permutation(lane, index)[max(0, first - base):]:
                yield base + k

    def positions(self, start: int = 0) -> Iterator[int]:
        """The epoch positions this slot delivers, from its item ``start`` on (no data
        read: for plans, tests and benchmarks)."""
        lanes = [self.lane_order(lane, first)
                 for lane, first in enumerate(self.lane_starts(start))]
        for item in range(start, self.size):
            lane = item % self.lanes
            yield self.work.at(self.starts[lane] + next(lanes[lane]))

    def remainder(self, delivered: int) -> list[Range]:
        """The work this slot has not delivered after ``delivered`` items: the rest of each
        lane's current block (sorted), then the rest of every lane."""
        left: list[int] = []
        lanes: list[Range] = []
        for lane, done in enumerate(self.lane_starts(min(delivered, self.size))):
            index = done // self.block
            base = index * self.block
            if base < self.lengths[lane]:
                left += [self.work.at(self.starts[lane] + base + k)
                         for k in self.permutation(lane, index)[done - base:]]
            lanes += self.lane(lane, min(base + self.block, self.lengths[lane])).ranges
        return merged(left) + lanes


class EpochPlan:
    """The chunk slots of one epoch under a sequence of layouts: every layout but the last
    delivered ``batches`` global batches, the last one is current."""

    def __init__(self, total: int, seed: int, epoch: int, lanes: int, block: int,
                 history: list[tuple[Layout | StreamLayout, int]], layout: Layout) -> None:
        self.seed, self.epoch, self.lanes, self.block = seed, epoch, lanes, block
        work = Work([(0, total)])
        for number, (old, batches) in enumerate(history):
            left = self._streams_left if isinstance(old, StreamLayout) else self._left
            work = left(work, old, number, batches)
        self.work, self.layout, self.number = work, layout, len(history)
        self.batches = layout.batches(work.size)
        self._bounds = self._slot_bounds(layout, self.batches)

    def slot(self, slot: int) -> SlotOrder:
        """The order of chunk slot ``slot`` under the current layout: chunk ``slot`` of
        global batch b is its items ``[b * n, (b + 1) * n)``, n = ``layout.chunk(slot)``."""
        return self._slot(self.work, self.number, self._bounds, slot)

    def chunk_positions(self, batch: int, slot: int) -> list[int]:
        """The positions of chunk ``slot`` of global batch ``batch``, in order (no data
        read: for tests and benchmarks)."""
        n = self.layout.chunk(slot)
        return list(itertools.islice(self.slot(slot).positions(batch * n), n))

    @staticmethod
    def _slot_bounds(layout: Layout, batches: int) -> list[int]:
        return [0, *accumulate(layout.chunk(c) * batches for c in range(layout.chunks))]

    def _slot(self, work: Work, number: int, bounds: list[int], slot: int) -> SlotOrder:
        seed = stable_int(self.seed, self.epoch, number, "slot", slot)
        return SlotOrder(work.cut(bounds[slot], bounds[slot + 1]), self.lanes, self.block,
                         seed)

    def _left(self, work: Work, layout: Layout, number: int, batches: int) -> Work:
        """The work left after ``batches`` global batches of ``layout``."""
        bounds = self._slot_bounds(layout, layout.batches(work.size))
        left: list[Range] = []
        for slot in range(layout.chunks):
            left += self._slot(work, number, bounds, slot).remainder(
                batches * layout.chunk(slot))
        return Work(left + work.cut(bounds[-1], work.size).ranges)

    def _streams_left(self, work: Work, layout: StreamLayout, number: int,
                      batches: int) -> Work:
        """The work left after each rank of a :class:`StreamLayout` delivered ``batches``
        batches: its (rank, worker) streams took consecutive slices, rank-major."""
        per_rank = work.size // layout.per_batch
        quotas = [layout.stream_batches(per_rank, w) * layout.share(r)
                  for r in range(layout.world) for w in range(layout.workers)]
        bounds = [0, *accumulate(quotas)]
        left: list[Range] = []
        for rank in range(layout.world):
            for worker in range(layout.workers):
                s = rank * layout.workers + worker
                stream = StreamOrder(work.cut(bounds[s], bounds[s + 1]), self.lanes,
                                     self.block,
                                     stable_int(self.seed, self.epoch, number, rank, worker))
                left += stream.remainder(layout.stream_batches(batches, worker)
                                         * layout.share(rank))
        return Work(left + work.cut(bounds[-1], work.size).ranges)
