"""The epoch plan: which samples each (rank, worker) stream reads, and in which order.

Positions. An epoch lays the data set out as one sequence: the shards in an order drawn
from (seed, epoch) alone, each shard's samples in file order. Position p is sample
``p - start[s]`` of the shard s whose span holds p. Work is a list of ``[a, b)`` position
ranges.

Layout. ``(world, workers, per_batch)``: a step takes ``per_batch`` positions over all
ranks (the global batch), rank r its share ``per_batch // world`` plus one for the first
``per_batch % world`` ranks. Each rank yields ``T = work // per_batch`` batches, worker w of
a rank the batches b < T with b % workers == w. The work is dealt to the streams
(rank-major, then worker) in consecutive slices of exactly the positions their batches
take, so every position is read once and every rank yields T batches; the last
``work - T * per_batch`` positions (less than one global batch) wait for the next epoch's
order.

Stream order. A stream cuts its slice into ``lanes`` consecutive parts and reads them side
by side: item t of its pre-order is item ``t // lanes`` of lane ``t % lanes`` (so its
batches mix ``lanes`` places of the data set). The pre-order is then shuffled in blocks of
``block`` items, each block by its own seeded permutation; batch i of the stream is items
``[i * share, (i + 1) * share)`` of the shuffled order (``share``: its rank's). Where a
stream stands is one number, the items it has delivered, and a stream resumes by reading
the block that holds it (:meth:`StreamOrder.lane_starts`).

Another layout mid-epoch (a resume on another number of ranks or workers, or another batch
size): the work left is every stream's :meth:`StreamOrder.remainder` (the undelivered
items of its current block, then the rest of its lanes) followed by the undealt tail, and
it is dealt again under the new layout. Nothing is lost or read twice.
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Iterator
from itertools import accumulate
from typing import NamedTuple

from data_pipeline.samples import stable_int

Range = tuple[int, int]  # [a, b) of epoch positions


class Layout(NamedTuple):
    world: int
    workers: int
    per_batch: int  # positions a step takes over all ranks

    def batches(self, work: int) -> int:
        """Batches per rank for ``work`` positions."""
        return work // self.per_batch

    def share(self, rank: int) -> int:
        """Positions rank ``rank``'s batch takes."""
        return self.per_batch // self.world + (rank < self.per_batch % self.world)

    def stream_batches(self, batches: int, worker: int) -> int:
        """How many of a rank's ``batches`` its worker ``worker`` yields."""
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


class StreamOrder:
    """The order of one stream's slice ``work``: lanes side by side, shuffled in blocks."""

    def __init__(self, work: Work, lanes: int, block: int, seed: int) -> None:
        self.work, self.block, self.seed = work, block, seed
        self.size = work.size
        self.lanes = max(1, min(lanes, self.size))
        base, extra = divmod(self.size, self.lanes)
        self.lengths = [base + (lane < extra) for lane in range(self.lanes)]
        self.starts = [0, *accumulate(self.lengths)]

    def lane(self, lane: int, first: int = 0) -> Work:
        """The work of ``lane`` from its item ``first`` on."""
        return self.work.cut(self.starts[lane] + first, self.starts[lane + 1])

    def lane_starts(self, item: int) -> list[int]:
        """Per lane, how many of its items come before pre-order item ``item``."""
        return [(item - lane + self.lanes - 1) // self.lanes if item > lane else 0
                for lane in range(self.lanes)]

    def block_lanes(self, index: int) -> list[int]:
        """The lane of each pre-order item of block ``index``."""
        first = index * self.block
        return [t % self.lanes for t in range(first, min(first + self.block, self.size))]

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


class EpochPlan:
    """The streams of one epoch under a sequence of layouts: every layout but the last
    delivered ``batches`` batches per rank, the last one is current."""

    def __init__(self, total: int, seed: int, epoch: int, lanes: int, block: int,
                 history: list[tuple[Layout, int]], layout: Layout) -> None:
        self.seed, self.epoch, self.lanes, self.block = seed, epoch, lanes, block
        work = Work([(0, total)])
        for number, (old, batches) in enumerate(history):
            work = self._left(work, old, number, batches)
        self.work, self.layout, self.number = work, layout, len(history)
        self.batches = layout.batches(work.size)

    def stream(self, rank: int, worker: int) -> StreamOrder:
        """The order of stream (rank, worker) under the current layout."""
        bounds = self._quotas(self.layout, self.batches)
        return self._stream(self.work, self.layout, self.number, bounds, rank, worker)

    @staticmethod
    def _quotas(layout: Layout, batches: int) -> list[int]:
        """Where each stream's slice of the work begins, rank-major, then worker."""
        return [0, *accumulate(layout.stream_batches(batches, w) * layout.share(r)
                               for r in range(layout.world) for w in range(layout.workers))]

    def _stream(self, work: Work, layout: Layout, number: int, bounds: list[int],
                rank: int, worker: int) -> StreamOrder:
        s = rank * layout.workers + worker
        seed = stable_int(self.seed, self.epoch, number, rank, worker)
        return StreamOrder(work.cut(bounds[s], bounds[s + 1]), self.lanes, self.block, seed)

    def _left(self, work: Work, layout: Layout, number: int, delivered_batches: int) -> Work:
        """The work left after each rank delivered ``delivered_batches`` batches."""
        bounds = self._quotas(layout, layout.batches(work.size))
        left: list[Range] = []
        for rank in range(layout.world):
            for worker in range(layout.workers):
                stream = self._stream(work, layout, number, bounds, rank, worker)
                done = layout.stream_batches(delivered_batches, worker) * layout.share(rank)
                left += stream.remainder(done)
        return Work(left + work.cut(bounds[-1], work.size).ranges)
