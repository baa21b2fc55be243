"""Column masks: the float form a tile's key comparison writes into a buffer leaves out
exactly the entries the bool form does, and float keys stay exact."""

from __future__ import annotations

import pytest
import torch

from pretrain.contrast.columns import (
    MASKED_LOGIT,
    ColumnSet,
    ColumnTiles,
    column_mask,
    float_keys,
)

NEGATIVES = ColumnSet("instance", positives=False)
POSITIVES = ColumnSet("label").positives_only


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("fill", [MASKED_LOGIT, 0.0])
@pytest.mark.parametrize("columns", [NEGATIVES, POSITIVES], ids=["negatives", "positives"])
@pytest.mark.parametrize("start", [0, 16])  # the anchors' own columns inside the tile, or not
def test_float_mask_fills_exactly_what_the_bool_mask_fills(dtype, fill, columns, start):
    gen = torch.Generator().manual_seed(0)
    keys = torch.randint(0, 5, (40,), generator=gen)
    anchor_index = torch.arange(12, 24)
    logits = torch.randn(12, 24, dtype=dtype, generator=gen) * 30
    tile = keys[start:start + 24]
    as_bool = column_mask(columns, anchor_index, keys[anchor_index], tile, start)
    slots = float_keys(keys, 5)
    as_float = column_mask(columns, anchor_index, slots[anchor_index], slots[start:start + 24],
                           start, buffer=lambda rows, width: torch.empty(rows, width,
                                                                         dtype=dtype))
    assert as_bool.drop.dtype == torch.bool and as_float.drop.dtype == dtype
    assert torch.equal(as_float.keep, as_bool.keep)
    assert as_bool.drop.any() and as_bool.keep.any()
    want = as_bool.apply(logits, fill)
    got = as_float.apply(logits, fill)
    assert torch.equal(got, want)  # bit for bit: lerp is exact at weights 0 and 1


def test_a_buffer_is_used_only_where_a_float_mask_means_the_same():
    """Padding columns or a negatives subset keep the bool form."""
    keys = torch.tensor([0, 0, 1, 1, 2, 2])
    slots, anchors = float_keys(keys, 3), torch.arange(6)
    def buffer(rows: int, width: int) -> torch.Tensor:
        return torch.empty(rows, width)

    valid = torch.tensor([True] * 5 + [False])
    padded = column_mask(NEGATIVES, anchors, slots, slots, 0, valid=valid, buffer=buffer)
    subset = column_mask(NEGATIVES, anchors, slots, slots, 0, buffer=buffer,
                         kept_negatives=torch.rand(6, 6) < 0.5)
    assert padded.drop.dtype == torch.bool and subset.drop.dtype == torch.bool
    assert padded.keep[:, 5].logical_not().all()


@pytest.mark.parametrize("columns", [ColumnSet("instance"), POSITIVES],
                         ids=["instance-all-but-own", "positives"])
def test_tiles_where_no_anchor_has_its_column_skip_the_own_column_step(columns):
    """With the anchors a known range of rows, a tile holding none of their own columns
    leaves the own-column step out and keeps exactly the columns of the general form."""
    keys = torch.arange(32) // 4
    slots = float_keys(keys, 8)
    anchor_index = torch.arange(8, 16)
    known = ColumnTiles(columns, anchor_index, slots[anchor_index], slots, anchor_start=8)
    unknown = ColumnTiles(columns, anchor_index, slots[anchor_index], slots)
    def buffer(rows: int, width: int) -> torch.Tensor:
        return torch.empty(rows, width)

    for start, rows, outside in [(0, slice(None), True), (16, slice(None), True),
                                 (8, slice(0, 4), False), (12, slice(0, 4), True),
                                 (4, slice(0, 4), False)]:
        fast = known.tile(start, start + 8, rows, buffer)
        general = unknown.tile(start, start + 8, rows, buffer)
        assert (fast.self_cols is None) == outside, (start, rows)
        assert general.self_cols is not None
        if fast.drop is not None or fast.self_cols is not None:
            assert torch.equal(fast.keep, general.keep), (start, rows)
        else:  # every column kept
            assert general.keep.all()


def test_float_keys_are_exact_past_float32s_integers():
    big = torch.tensor([2**24, 2**24 + 1])
    assert float_keys(big, 2**24 + 2).dtype == torch.float64
    assert float_keys(big, 2**24 + 2).unique().numel() == 2
    assert float_keys(torch.tensor([3, 4]), 2**24).dtype == torch.float32
