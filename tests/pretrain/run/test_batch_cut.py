"""How a step's global batch is cut across the current world: shares that sum to it and
differ by at most one, chunks of at most the configured rows where a share outgrows them,
and the global batch a run's checkpoints record."""

from __future__ import annotations

import pytest
import torch

from pretrain.run.batch_cut import BatchCut, recorded_global_batch


@pytest.mark.parametrize(("global_batch", "world"), [(64, 1), (64, 2), (64, 3), (65, 4),
                                                     (7, 7), (1024, 48)])
def test_shares_sum_to_the_global_batch_and_differ_by_at_most_one(global_batch, world):
    cut = BatchCut(global_batch, world, per_rank=32)
    shares = [cut.share(rank) for rank in range(world)]
    assert sum(shares) == global_batch and max(shares) - min(shares) <= 1
    assert cut.rows_per_rank == 2 * max(shares)


def test_a_share_beyond_the_configured_batch_is_encoded_in_chunks_of_it():
    assert BatchCut(64, 2, per_rank=32).chunk_rows(0) == 0  # the world it began with
    assert BatchCut(64, 3, per_rank=32).chunk_rows(0) == 0  # more ranks: smaller shares
    lost = BatchCut(64, 1, per_rank=32)  # a rank lost: 64 instances, 128 rows
    assert lost.chunk_rows(0) == 64 and lost.rows_per_rank == 128
    assert lost.chunk_rows(16) == 16  # train.chunk_size, when set, is kept
    assert BatchCut(64, 1, per_rank=32, chunkable=False).chunk_rows(0) == 0  # split views
    assert lost.describe(0) == ("global batch 64 on 1 rank(s): 64 instances a rank, "
                                "encoded in chunks of at most 64 rows")
    assert BatchCut(64, 3, 32).describe(0) == ("global batch 64 on 3 rank(s): 21 or 22 "
                                               "instances a rank, encoded at once")


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
