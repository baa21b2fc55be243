"""How a step's global batch is cut across the current world: whole chunks of the
configured batch, as many on every rank or one more, pieces of a chunk's rows where a rank
holds more than one, and the global batch a run's checkpoints record."""

from __future__ import annotations

import pytest
import torch

from pretrain.run.batch_cut import BatchCut, recorded_global_batch


@pytest.mark.parametrize(("global_batch", "world"), [(64, 1), (64, 2), (64, 3), (65, 3),
                                                     (7, 1), (1024, 32)])
def test_ranks_take_whole_chunks_that_sum_to_the_global_batch(global_batch, world):
    cut = BatchCut(global_batch, world, per_chunk=16)
    shares = [cut.share(rank) for rank in range(world)]
    assert sum(shares) == global_batch
    chunks = [len(cut.chunks.slots(r, world)) for r in range(world)]
    assert max(chunks) - min(chunks) <= 1 and cut.chunks_per_rank == max(chunks)
    assert cut.rows_per_rank == 2 * max(shares)
    assert all(share <= 16 * count for share, count in zip(shares, chunks, strict=True))


def test_a_rank_with_more_than_one_chunk_encodes_them_one_at_a_time():
    assert BatchCut(64, 2, per_chunk=32).chunk_rows(0) == 0  # a chunk a rank: at once
    lost = BatchCut(64, 1, per_chunk=32)  # a rank lost: 2 chunks, 128 rows
    assert lost.chunk_rows(0) == 64 and lost.rows_per_rank == 128
    assert lost.pieces(64) == (1, 2)  # a piece a chunk, 2 on every rank
    assert lost.chunk_rows(16) == 16 and lost.pieces(16) == (4, 8)  # train.chunk_size
    uneven = BatchCut(64, 3, per_chunk=16)  # 4 chunks on 3 ranks: 2, 1, 1
    assert [uneven.share(r) for r in range(3)] == [32, 16, 16]
    assert uneven.pieces(uneven.chunk_rows(0)) == (1, 2)
    assert lost.describe(0) == ("global batch 64 on 1 rank(s): 2 chunk(s) of 32 instances "
                                "a rank, encoded in pieces of at most 64 rows")
    assert BatchCut(64, 2, 32).describe(0) == ("global batch 64 on 2 rank(s): 1 chunk(s) of "
                                               "32 instances a rank, encoded at once")


def test_the_newest_readable_checkpoint_gives_the_global_batch(tmp_path):
    def checkpoint(step: int, global_batch: int | None) -> object:
        path = tmp_path / f"step_{step:08d}"
        path.mkdir()
        if global_batch is not None:
            torch.save({"global_batch": global_batch, "model": {"w": torch.zeros(3)}},
                       path / "shared.pt")
        return path

    old, unreadable = checkpoint(4, 48), checkpoint(8, None)
    (unreadable / "shared.pt").write_bytes(b"truncated")
    assert recorded_global_batch([unreadable, old]) == 48
    assert recorded_global_batch([]) == 0
