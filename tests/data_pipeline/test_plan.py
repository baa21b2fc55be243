"""The epoch plan, positions only (nothing read): every sample once per epoch, global
batches of chunk slots whose order depends on (seed, epoch, data, layout) alone, dealt to
any world whole, and exact resume at any batch, under the same layout or another one
(another global batch or chunk size, or a state saved before chunk slots, whose
(rank, worker) streams are re-derived here from their documented rule)."""

from __future__ import annotations

import random
from itertools import accumulate

import pytest

from data_pipeline.loader.plan import (
    EpochPlan,
    Layout,
    ShardOrder,
    SlotOrder,
    StreamLayout,
    StreamOrder,
    Work,
)
from data_pipeline.samples import stable_int

COUNTS = [random.Random(5).randrange(20, 400) for _ in range(40)]  # 40 uneven shards
TOTAL = sum(COUNTS)
LANES, BLOCK = 4, 32
# (samples a step, samples a chunk): 25 and 100 end in a short chunk
LAYOUTS = [Layout(16, 16), Layout(24, 8), Layout(25, 8), Layout(64, 16), Layout(100, 7),
           Layout(128, 2)]


def plan(layout: Layout, history=(), seed: int = 0, epoch: int = 0) -> EpochPlan:
    return EpochPlan(TOTAL, seed, epoch, LANES, BLOCK, list(history), layout)


def batches(p: EpochPlan, first: int = 0, stop: int | None = None) -> list[list[int]]:
    """The positions of global batches [first, stop), each its chunks in slot order."""
    stop = p.batches if stop is None else stop
    return [[q for slot in range(p.layout.chunks) for q in p.chunk_positions(b, slot)]
            for b in range(first, stop)]


def flat(delivered: list[list[int]]) -> list[int]:
    return [q for batch in delivered for q in batch]


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_an_epoch_reads_every_sample_once_in_whole_chunks(layout):
    p = plan(layout)
    delivered = batches(p)
    assert p.batches == TOTAL // layout.per_batch > 0
    sizes = [layout.chunk(c) for c in range(layout.chunks)]
    assert sum(sizes) == layout.per_batch and set(sizes[:-1]) <= {layout.per_chunk}
    assert all(len(p.chunk_positions(b, c)) == sizes[c]
               for b in (0, p.batches - 1) for c in range(layout.chunks))
    seen = flat(delivered)
    assert len(seen) == len(set(seen))  # nothing twice
    assert set(seen) <= set(range(TOTAL))
    assert TOTAL - len(seen) < layout.per_batch  # less than a global batch left


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_every_world_takes_whole_chunks_each_once(layout):
    """Rank r of W takes consecutive chunk slots, as many as any other rank or one more;
    over the ranks, every slot once."""
    for world in range(1, layout.chunks + 1):
        slots = [layout.slots(rank, world) for rank in range(world)]
        assert [c for s in slots for c in s] == list(range(layout.chunks))
        counts = [len(s) for s in slots]
        assert max(counts) - min(counts) <= 1 and min(counts) >= 1


def test_fewer_shards_than_slots_split_shards_by_sample_ranges():
    p = plan(Layout(512, 1))  # 512 slots over 40 shards
    order = ShardOrder(COUNTS, 0, 0)
    pieces = [list(order.pieces(p.slot(c).work)) for c in range(512)]
    assert all(len(slot) <= 2 for slot in pieces)  # a slot reads 1-2 shard ranges
    per_shard: dict[int, list[tuple[int, int]]] = {}
    for slot in pieces:
        for shard, first, stop, _ in slot:
            per_shard.setdefault(shard, []).append((first, stop))
    for shard, ranges in per_shard.items():  # the ranges of a shard tile it, no overlap
        ranges.sort()
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
        assert ranges[0][0] == 0 and ranges[-1][1] <= COUNTS[shard]


def test_the_order_is_fixed_by_seed_and_epoch():
    layout = Layout(25, 8)
    assert batches(plan(layout)) == batches(plan(layout))
    assert batches(plan(layout, seed=1)) != batches(plan(layout))
    assert batches(plan(layout, epoch=1)) != batches(plan(layout))
    assert ShardOrder(COUNTS, 0, 0).order == ShardOrder(COUNTS, 0, 0).order


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_the_slots_deal_a_prefix_of_one_sequence(layout):
    """The slots' slices, joined in order, are the epoch's first T * global batch
    positions."""
    p = plan(layout)
    joined = [r for c in range(layout.chunks) for r in p.slot(c).work.ranges]
    merged = [joined[0]]
    for a, b in joined[1:]:
        assert a == merged[-1][1]
        merged[-1] = (merged[-1][0], b)
    assert merged == [(0, p.batches * layout.per_batch)]


@pytest.mark.parametrize("layout", LAYOUTS[1:], ids=str)
def test_a_slot_resumes_at_any_item_exactly(layout):
    slot = plan(layout).slot(layout.chunks - 1)
    full = list(slot.positions())
    for item in range(0, len(full) + 1, 7):
        assert list(slot.positions(item)) == full[item:]


@pytest.mark.parametrize(("old", "new"), [
    (Layout(24, 8), Layout(24, 12)),   # another data.batch_size, the global batch kept
    (Layout(64, 16), Layout(32, 16)),  # per_rank: a rank lost
    (Layout(16, 16), Layout(48, 16)),  # per_rank: ranks gained
    (Layout(128, 2), Layout(100, 7)),
    (Layout(100, 7), Layout(128, 2)),
], ids=["b8-b12", "4r-2r", "1r-3r", "128-100", "100-128"])
def test_a_resume_under_another_layout_loses_and_repeats_nothing(old, new):
    first = plan(old)
    for stop in (1, first.batches // 3, first.batches - 1):
        before = flat(batches(first, 0, stop))
        after = flat(batches(plan(new, [(old, stop)])))
        seen = before + after
        assert len(seen) == len(set(seen))  # nothing twice
        assert TOTAL - len(seen) < new.per_batch  # nothing lost but the tail


def test_layouts_chain_within_an_epoch():
    a, b, c = Layout(32, 4), Layout(25, 8), Layout(128, 16)
    before_a = flat(batches(plan(a), 0, 5))
    before_b = flat(batches(plan(b, [(a, 5)]), 0, 11))
    after = flat(batches(plan(c, [(a, 5), (b, 11)])))
    seen = before_a + before_b + after
    assert len(seen) == len(set(seen)) and TOTAL - len(seen) < 128


def stream_delivered(old: StreamLayout, batches_done: int) -> list[int]:
    """What a state saved before chunk slots says was delivered, by that plan's rule: the
    epoch dealt to (rank, worker) streams in consecutive slices (rank-major), each its
    batches' positions (rank r's share of ``per_batch``, worker w the batches b with b %
    workers == w), each stream ordered as a :class:`StreamOrder` seeded by (seed, epoch,
    layout number, rank, worker)."""
    per_rank = TOTAL // old.per_batch
    shares = [old.per_batch // old.world + (r < old.per_batch % old.world)
              for r in range(old.world)]
    quotas = [len(range(w, per_rank, old.workers)) * shares[r]
              for r in range(old.world) for w in range(old.workers)]
    bounds = [0, *accumulate(quotas)]
    out = []
    for r in range(old.world):
        for w in range(old.workers):
            s = r * old.workers + w
            stream = StreamOrder(Work([(bounds[s], bounds[s + 1])]), LANES, BLOCK,
                                 stable_int(0, 0, 0, r, w))
            done = len(range(w, batches_done, old.workers)) * shares[r]
            out += list(stream.positions())[:done]
    return out


@pytest.mark.parametrize("old", [StreamLayout(3, 2, 24), StreamLayout(1, 1, 64)],
                         ids=["3x2", "1x1"])
def test_a_state_saved_before_chunk_slots_continues_exactly(old):
    for stop in (1, TOTAL // old.per_batch // 2):
        before = stream_delivered(old, stop)
        after = flat(batches(plan(Layout(32, 8), [(old, stop)])))
        seen = before + after
        assert len(seen) == len(set(seen)) and TOTAL - len(seen) < 32


@pytest.mark.parametrize("kind", [SlotOrder, StreamOrder], ids=["slot", "stream"])
def test_a_remainder_is_what_was_not_delivered(kind):
    stream = kind(Work([(0, 50), (100, 163)]), lanes=3, block=10, seed=1)
    full = list(stream.positions())
    assert sorted(full) == list(range(50)) + list(range(100, 163))
    for delivered in (0, 1, 9, 10, 37, 112, 113):
        rest = [p for a, b in stream.remainder(delivered) for p in range(a, b)]
        assert sorted(rest) == sorted(full[delivered:])


def test_chunks_take_an_equal_share_of_every_lane_of_a_slot():
    """A chunk of 8 draws 2 items from each quarter of the slot's slice (its 4 lanes), each
    a shuffled pick of the lane's current block, whichever item it starts at."""
    slot = SlotOrder(Work([(0, 4000)]), lanes=4, block=64, seed=0)
    full = list(slot.positions())
    assert sorted(full) == list(range(4000))
    for start in (0, 8, 13, 997):
        chunk = full[start:start + 8]
        assert sorted(p // 1000 for p in chunk) == sorted((start + i) % 4 for i in range(8))
        assert list(slot.positions(start))[:8] == chunk
    assert full[:16] != sorted(full[:16])
