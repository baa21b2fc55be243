"""Features extracted by 2 ranks (each sample exactly once) equal those of 1 process, on
rank 0 only, whatever the size of the chunks they travel in, and when written to files as
the kNN bank."""

from __future__ import annotations

import pytest
import torch

from tests.data_pipeline.helpers import uneven_set
from tests.evaluation import rank_tasks


@pytest.mark.parametrize("transfer_mib", [64, 0])  # 0: one row a chunk, many chunks
def test_two_ranks_extract_what_one_process_does(gloo2, tmp_path, transfer_mib):
    uneven_set(tmp_path / "shards", [23, 9, 31, 5, 17])  # 85 samples in 5 uneven shards
    ranks = gloo2.run(rank_tasks.features_on_rank, str(tmp_path / "shards"), None, None,
                      transfer_mib)
    single = rank_tasks.features_on_rank(str(tmp_path / "shards"), 0, 1)
    assert len(single["keys"]) == 85 and len(set(single["keys"])) == 85
    assert ranks[1] is None  # the features go to rank 0 only
    # float32 features of the same images in other batches: batch-size-dependent kernels
    # round differently (~1e-7 relative per op, features of order 1), never by 1e-5
    for got in ranks[:1]:
        assert got["keys"] == single["keys"]
        assert torch.equal(got["labels"], single["labels"])
        torch.testing.assert_close(got["backbone"], single["backbone"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got["projector"], single["projector"], rtol=1e-5, atol=1e-5)


def test_two_ranks_write_the_bank_one_process_extracts(gloo2, tmp_path):
    """Each rank writes its share of the bank; rank 0 reads it in key order: the rows and
    labels one process extracts (the tolerance as above)."""
    uneven_set(tmp_path / "shards", [23, 9, 31, 5, 17])
    ranks = gloo2.run(rank_tasks.bank_on_rank, str(tmp_path / "shards"), str(tmp_path / "b"))
    single = rank_tasks.features_on_rank(str(tmp_path / "shards"), 0, 1)
    assert ranks[1] is None
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == sorted(
        f"rank{r}.{what}" for r in (0, 1) for what in ("backbone.f32", "projector.f32",
                                                          "keys.npy", "labels.npy"))
    assert torch.equal(ranks[0]["labels"], single["labels"])
    torch.testing.assert_close(ranks[0]["backbone"], single["backbone"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ranks[0]["projector"], single["projector"], rtol=1e-5,
                               atol=1e-5)


def test_fsdp2_ranks_extract_what_one_process_does(gloo2, tmp_path):
    """The kNN monitor's path under FSDP2: the encoder sharded over 2 ranks, its root
    gathered (``whole_root``), ranks with fewer batches running empty ones in lockstep."""
    uneven_set(tmp_path / "shards", [23, 9, 31, 5, 17])
    ranks = gloo2.run(rank_tasks.sharded_features_on_rank, str(tmp_path / "shards"))
    single = rank_tasks.features_on_rank(str(tmp_path / "shards"), 0, 1)
    assert ranks[1] is None
    assert ranks[0]["keys"] == single["keys"] and len(single["keys"]) == 85
    torch.testing.assert_close(ranks[0]["backbone"], single["backbone"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ranks[0]["projector"], single["projector"], rtol=1e-5,
                               atol=1e-5)


def test_ranks_in_lockstep_run_as_many_batches_as_the_longest(gloo2):
    """Rank 0 holds 3 batches, rank 1 one: both run 3, rank 1's last two empty."""
    assert gloo2.run(lockstep_on_rank) == [[3, 3, 3], [3, 0, 0]]


def lockstep_on_rank() -> list[int]:
    import torch.distributed as dist

    return rank_tasks.lockstep_counts(3 if dist.get_rank() == 0 else 1)
