"""Column masks: the float form a tile's key comparison writes into a buffer leaves out
exactly the entries the bool form does, and float keys stay exact."""

from __future__ import annotations

import pytest
import torch

from pretrain.losses.columns import MASKED_LOGIT, ColumnSet, column_mask, float_keys

NEGATIVES = ColumnSet("instance", positives=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("fill", [MASKED_LOGIT, 0.0])
def test_float_mask_fills_exactly_what_the_bool_mask_fills(dtype, fill):
    gen = torch.Generator().manual_seed(0)
    keys = torch.randint(0, 5, (40,), generator=gen)
    anchor_index = torch.arange(12, 24)
    logits = torch.randn(12, 40, dtype=dtype, generator=gen) * 30
    as_bool = column_mask(NEGATIVES, anchor_index, keys[anchor_index], keys, 0)
    slots = float_keys(keys, 5)
    as_float = column_mask(NEGATIVES, anchor_index, slots[anchor_index], slots, 0,
                           buffer=lambda rows, width: torch.empty(rows, width, dtype=dtype))
    assert as_bool.drop.dtype == torch.bool and as_float.drop.dtype == dtype
    assert torch.equal(as_float.keep, as_bool.keep)
    assert as_bool.drop.any() and as_bool.keep.any()
    want = as_bool.apply(logits, fill)
    got = as_float.apply(logits, fill)
    assert torch.equal(got, want)  # bit for bit: lerp is exact at weights 0 and 1


def test_a_buffer_is_used_only_where_a_float_mask_means_the_same():
    """Padding columns, a negatives subset or positives keep the bool form."""
    keys = torch.tensor([0, 0, 1, 1, 2, 2])
    slots, anchors = float_keys(keys, 3), torch.arange(6)
    def buffer(rows: int, width: int) -> torch.Tensor:
        return torch.empty(rows, width)

    valid = torch.tensor([True] * 5 + [False])
    padded = column_mask(NEGATIVES, anchors, slots, slots, 0, valid=valid, buffer=buffer)
    positives = column_mask(ColumnSet("instance").positives_only, anchors, slots, slots, 0,
                            buffer=buffer)
    assert padded.drop.dtype == torch.bool and positives.drop.dtype == torch.bool
    assert padded.keep[:, 5].logical_not().all()


def test_float_keys_are_exact_past_float32s_integers():
    big = torch.tensor([2**24, 2**24 + 1])
    assert float_keys(big, 2**24 + 2).dtype == torch.float64
    assert float_keys(big, 2**24 + 2).unique().numel() == 2
    assert float_keys(torch.tensor([3, 4]), 2**24).dtype == torch.float32
