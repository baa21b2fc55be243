"""The epoch plan at simulated worlds up to 64 ranks x 8 workers (positions only, nothing
read): every sample once per epoch, as many batches on every rank (each its share of the
global batch, uneven where the world does not divide it), a seeded order, and exact resume
at any batch, under the same layout or another one (another world keeping the global
batch included)."""

from __future__ import annotations

import random

import pytest

from data_pipeline.loader.plan import EpochPlan, Layout, ShardOrder, StreamOrder, Work

COUNTS = [random.Random(5).randrange(20, 400) for _ in range(40)]  # 40 uneven shards
TOTAL = sum(COUNTS)
LANES, BLOCK = 4, 32
# (world, workers, samples a step over all ranks): 3 x 2 and 5 x 2 cut it unevenly
WORLDS = [Layout(1, 1, 16), Layout(3, 2, 24), Layout(3, 2, 25), Layout(5, 2, 64),
          Layout(8, 8, 32), Layout(64, 8, 128)]


def plan(layout: Layout, history=(), seed: int = 0, epoch: int = 0) -> EpochPlan:
    return EpochPlan(TOTAL, seed, epoch, LANES, BLOCK, list(history), layout)


def batches(p: EpochPlan, first: int = 0, stop: int | None = None) -> list[list[list[int]]]:
    """[rank][batch] -> the positions of that batch, batches [first, stop) of the layout."""
    layout = p.layout
    stop = p.batches if stop is None else stop
    out = []
    for rank in range(layout.world):
        streams = [list(p.stream(rank, w).positions()) for w in range(layout.workers)]
        share = layout.share(rank)
        out.append([streams[b % layout.workers][(b // layout.workers) * share:
                                                (b // layout.workers + 1) * share]
                    for b in range(first, stop)])
    return out


def flat(delivered: list[list[list[int]]]) -> list[int]:
    return [p for rank in delivered for batch in rank for p in batch]


@pytest.mark.parametrize("layout", WORLDS, ids=lambda x: f"{x.world}x{x.workers}")
def test_an_epoch_reads_every_sample_once_with_a_share_per_rank(layout):
    p = plan(layout)
    delivered = batches(p)
    assert p.batches == TOTAL // layout.per_batch > 0
    assert all(len(rank) == p.batches for rank in delivered)
    shares = [layout.share(r) for r in range(layout.world)]
    assert sum(shares) == layout.per_batch and max(shares) - min(shares) <= 1
    assert all(len(b) == shares[r] for r, rank in enumerate(delivered) for b in rank)
    seen = flat(delivered)
    assert len(seen) == len(set(seen))  # nothing twice
    assert set(seen) <= set(range(TOTAL))
    assert TOTAL - len(seen) < layout.per_batch  # less than a global batch left


def test_fewer_shards_than_streams_split_shards_by_sample_ranges():
    p = plan(Layout(64, 8, 128))  # 512 streams over 40 shards
    order = ShardOrder(COUNTS, 0, 0)
    pieces = [list(order.pieces(p.stream(r, w).work)) for r in range(64) for w in range(8)]
    assert all(len(streams) <= 2 for streams in pieces)  # a stream reads 1-2 shard ranges
    per_shard: dict[int, list[tuple[int, int]]] = {}
    for streams in pieces:
        for shard, first, stop, _ in streams:
            per_shard.setdefault(shard, []).append((first, stop))
    for shard, ranges in per_shard.items():  # the ranges of a shard tile it, no overlap
        ranges.sort()
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
        assert ranges[0][0] == 0 and ranges[-1][1] <= COUNTS[shard]


def test_the_order_is_fixed_by_seed_and_epoch():
    layout = Layout(3, 2, 25)
    assert batches(plan(layout)) == batches(plan(layout))
    assert batches(plan(layout, seed=1)) != batches(plan(layout))
    assert batches(plan(layout, epoch=1)) != batches(plan(layout))
    assert ShardOrder(COUNTS, 0, 0).order == ShardOrder(COUNTS, 0, 0).order


@pytest.mark.parametrize("layout", WORLDS, ids=lambda x: f"{x.world}x{x.workers}")
def test_every_world_deals_a_prefix_of_one_sequence(layout):
    """The world changes how the epoch's sequence is dealt, not the sequence: the streams'
    slices, joined in order, are its first T * global batch positions."""
    p = plan(layout)
    joined = [r for rank in range(layout.world) for w in range(layout.workers)
              for r in p.stream(rank, w).work.ranges]
    merged = [joined[0]]
    for a, b in joined[1:]:
        assert a == merged[-1][1]
        merged[-1] = (merged[-1][0], b)
    assert merged == [(0, p.batches * layout.per_batch)]


@pytest.mark.parametrize("layout", WORLDS[1:], ids=lambda x: f"{x.world}x{x.workers}")
def test_a_stream_resumes_at_any_item_exactly(layout):
    p = plan(layout)
    stream = p.stream(layout.world - 1, layout.workers - 1)
    full = list(stream.positions())
    for item in range(0, len(full) + 1, 7):
        assert list(stream.positions(item)) == full[item:]


@pytest.mark.parametrize(("old", "new"), [
    (Layout(3, 2, 24), Layout(2, 3, 24)),
    (Layout(2, 1, 64), Layout(1, 1, 64)),  # a rank lost, the global batch kept
    (Layout(1, 1, 64), Layout(3, 2, 64)),  # ranks gained: shares 22, 21, 21
    (Layout(8, 8, 32), Layout(64, 8, 128)),
    (Layout(64, 8, 128), Layout(8, 8, 32)),
    (Layout(8, 8, 32), Layout(8, 2, 32)),   # another worker count
    (Layout(8, 8, 32), Layout(8, 8, 48)),   # another batch size
], ids=["3x2-2x3", "2-1-kept", "1-3-kept", "8x8-64x8", "64x8-8x8", "8x8-8x2", "8x8-b6"])
def test_a_resume_under_another_layout_loses_and_repeats_nothing(old, new):
    first = plan(old)
    for stop in (1, first.batches // 3, first.batches - 1):
        before = flat(batches(first, 0, stop))
        after = flat(batches(plan(new, [(old, stop)])))
        seen = before + after
        assert len(seen) == len(set(seen))  # nothing twice
        assert TOTAL - len(seen) < new.per_batch  # nothing lost but the tail


def test_layouts_chain_within_an_epoch():
    a, b, c = Layout(8, 8, 32), Layout(3, 2, 25), Layout(64, 8, 128)
    before_a = flat(batches(plan(a), 0, 5))
    before_b = flat(batches(plan(b, [(a, 5)]), 0, 11))
    after = flat(batches(plan(c, [(a, 5), (b, 11)])))
    seen = before_a + before_b + after
    assert len(seen) == len(set(seen)) and TOTAL - len(seen) < 128


def test_a_remainder_is_what_the_stream_did_not_deliver():
    stream = StreamOrder(Work([(0, 50), (100, 163)]), lanes=3, block=10, seed=1)
    full = list(stream.positions())
    assert sorted(full) == list(range(50)) + list(range(100, 163))
    for delivered in (0, 1, 9, 10, 37, 112, 113):
        rest = [p for a, b in stream.remainder(delivered) for p in range(a, b)]
        assert sorted(rest) == sorted(full[delivered:])


def test_batches_mix_the_lanes_of_a_stream():
    """A stream's batch draws from all its lanes: a batch of 8 spans the stream's slice."""
    stream = StreamOrder(Work([(0, 4000)]), lanes=4, block=64, seed=0)
    first = list(stream.positions())[:8]
    assert len({p // 1000 for p in first}) >= 3  # of the 4 quarters of the slice
