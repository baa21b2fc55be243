"""The main process's join of the workers' pieces (``data_pipeline/loader/collate.py``):
each picked row lands where the batch puts it, equal to joining the parts and selecting
the rows, whichever parts are whole or picked in part, pinned or not."""

from __future__ import annotations

import pytest
import torch

from data_pipeline.config import DataConfig
from data_pipeline.loader.collate import ChunkJoiner


def joined_then_selected(parts: list[torch.Tensor], picked: list[tuple[int, int]]) -> torch.Tensor:
    """The plain reference: every part in one tensor, then the picked rows by index."""
    offsets = [sum(len(p) for p in parts[:k]) for k in range(len(parts))]
    return torch.cat(parts)[torch.tensor([offsets[k] + i for k, i in picked])]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
def test_the_picked_rows_equal_those_of_the_joined_parts(dtype):
    gen = torch.Generator().manual_seed(0)
    parts = [(torch.rand(n, 3, 4, 4, generator=gen) * 100).to(dtype) for n in (6, 4, 2)]
    # part 0 whole but interleaved with part 1; part 1 in part and out of order; part 2 once
    picked = [(0, 0), (1, 3), (0, 1), (0, 2), (1, 0), (0, 3), (0, 4), (2, 1), (0, 5)]
    joiner = ChunkJoiner(DataConfig(), None, range(1), labelled=False)
    got = joiner._rows(parts, picked)["images"]
    assert got.dtype == dtype
    assert torch.equal(got, joined_then_selected(parts, picked))


def test_one_part_in_order_is_handed_on_as_it_came():
    part = torch.rand(4, 3, 2, 2)
    joiner = ChunkJoiner(DataConfig(), None, range(1), labelled=False)
    assert joiner._rows([part], [(0, i) for i in range(4)])["images"] is part
