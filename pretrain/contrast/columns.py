"""Which columns of each anchor's row enter a row-wise reduction, densely or one tile of
columns at a time.

A row of anchor i runs over the N candidates j. Its negatives are the candidates whose key
(instance id or class label) differs from i's, restricted under ``num_negatives`` to a
seeded subset of k; a :class:`ColumnSet` adds the anchor's positives and/or its own
column. The subset is the k negatives of smallest :func:`subset_scores`: scores are unique
within a row, so the dense path (a top-k over the row) and the tiled path (a threshold
found tile by tile) keep exactly the same negatives.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

PositiveKind = Literal["instance", "label"]

_HASH_MULTIPLIERS = (0x2C1B3C6D, 0x297A2D39, 0x7FEB352D)
_MASK32 = 0xFFFFFFFF
# Stands in for -inf at masked logits: exp() of it is exactly 0, yet rows with nothing left
# stay finite in forward and backward (a row of -inf makes logsumexp's backward NaN).
MASKED_LOGIT = -1e30
# Where a sum's masked entries need not be exactly 0: an exp whose result underflows takes a
# slow path on x86 CPUs (16x), and N e^-80 vanishes beside a sum that holds its max's e^0
NEGLIGIBLE_LOG_WEIGHT = -80.0
NOT_A_NEGATIVE = torch.iinfo(torch.int64).max  # the score of a column outside the subset's pool
Buffer = Callable[[int, int], Tensor]  # (rows, width) -> a reused [rows, width] float tensor


def _mix32(x: Tensor) -> Tensor:
    """A 32-bit integer hash on int64 tensors; every product stays below 2**63."""
    for mult in _HASH_MULTIPLIERS:
        x = x ^ (x >> 16)
        x = (x * mult) & _MASK32
    return x ^ (x >> 16)


def pair_hash(seed: int, rows: Tensor, cols: Tensor) -> Tensor:
    """Deterministic pseudo-random int in [0, 2**32) per (seed, global row, global column),
    [n, T] for ``rows`` [n] and ``cols`` [T]."""
    row_key = _mix32((rows.long() * 0x01000193 + seed * 0x9E3779B) & _MASK32)
    return _mix32((row_key[:, None] * 0x01000193 + cols.long()[None, :]) & _MASK32)


def subset_scores(seed: int, rows: Tensor, cols: Tensor, num_candidates: int,
                  positions: Tensor | None = None) -> Tensor:
    """[n, T] int64 scores, unique within a row: pair_hash * N + column (below 2**63).

    ``rows`` and ``cols`` are positions in the global batch; with ``positions`` [N] (each
    row's place among the real rows, when padding rows sit between them) the hash reads
    those places, so a padded gather keeps the negatives one process keeps. The order of
    the scores is that of (hash, column) for any N above the largest column."""
    if positions is not None:
        rows, cols = positions[rows], positions[cols]
    return pair_hash(seed, rows, cols) * num_candidates + cols.long()[None, :]


@dataclass(frozen=True)
class ColumnSet:
    """The columns of a reduction: the negatives of ``kind`` (unless
    ``include_negatives`` is false), plus the anchor's other positives (``positives``) and
    its own column (``self_column``)."""

    kind: PositiveKind
    positives: bool = True
    self_column: bool = False
    include_negatives: bool = True

    @property
    def negatives(self) -> ColumnSet:
        """The negatives alone: the columns the ESS and negative-cosine monitors read."""
        return ColumnSet(self.kind, positives=False, self_column=False)

    @property
    def positives_only(self) -> ColumnSet:
        """The anchor's other positives alone (the positives' monitors, SINCERE's pairs)."""
        return ColumnSet(self.kind, positives=True, self_column=False, include_negatives=False)


@dataclass(frozen=True)
class Columns:
    """The columns of a row-wise reduction over an [n, T] block: every column but those
    ``drop`` marks ([n, T] bool, or float 1.0 and 0.0 from a comparison of float keys) and
    each row's own column ``self_cols`` ([n], the column of the row's own candidate in the
    block, left out where it lies in [0, T)). Leaving out only the own column costs O(n)
    instead of an [n, T] comparison."""

    width: int
    drop: Tensor | None = None
    self_cols: Tensor | None = None

    @property
    def keep(self) -> Tensor:
        """[n, T] bool: the columns kept."""
        kept = None
        if self.drop is not None:
            kept = self.drop == 0 if self.drop.is_floating_point() else ~self.drop
        if self.self_cols is not None:
            cols = torch.arange(self.width, device=self.self_cols.device)
            own = cols[None, :] != self.self_cols[:, None]
            return own if kept is None else own & kept
        if kept is None:
            raise ValueError("Columns.keep: every column is kept and the rows are unknown")
        return kept

    def fill_(self, logits: Tensor, fill: float) -> Tensor:
        """Set the left-out entries of ``logits`` [n, T] (finite) to ``fill`` in place."""
        if self.drop is not None and self.drop.is_floating_point():
            # lerp is exact at weights 0 and 1, and on CPUs several times faster than
            # masked_fill_ with a bool mask
            logits.lerp_(logits.new_tensor(fill).expand_as(logits),
                         self.drop.to(logits.dtype))
        elif self.drop is not None:
            logits.masked_fill_(self.drop, fill)
        if self.self_cols is not None:
            inside = (self.self_cols >= 0) & (self.self_cols < self.width)
            col = self.self_cols.clamp(0, self.width - 1)[:, None]
            current = logits.gather(1, col)
            logits.scatter_(1, col, torch.where(inside[:, None],
                                                torch.full_like(current, fill), current))
        return logits

    def apply(self, logits: Tensor, fill: float, out: Tensor | None = None) -> Tensor:
        """A copy of ``logits`` [n, T] (into ``out``, if given) with the left-out entries
        set to ``fill``: one pass where a bool mask is all there is to apply."""
        if self.self_cols is None and self.drop is not None and not \
                self.drop.is_floating_point():
            return torch.where(self.drop, logits.new_full((), fill), logits, out=out)
        return self.fill_(logits.clone() if out is None else out.copy_(logits), fill)


def column_mask(columns: ColumnSet, anchor_index: Tensor, anchor_keys: Tensor, keys: Tensor,
                start: int, kept_negatives: Tensor | None = None,
                valid: Tensor | None = None, buffer: Buffer | None = None,
                own_columns_outside: bool = False) -> Columns:
    """The :class:`Columns` of ``columns`` over the candidate columns [start, start + T)
    (keys ``keys`` [T]) for anchors at ``anchor_index`` [n] with keys ``anchor_keys`` [n].
    ``kept_negatives`` [n, T] restricts the negatives to a subset; ``valid`` [T] leaves out
    padding columns; ``buffer`` may hold the mask (float keys), asked for only then;
    ``own_columns_outside``: no anchor's own column lies in [start, start + T).
    Fixed shapes: no value is read back to the host."""
    width = keys.shape[0]
    invalid = None if valid is None else ~valid[None, :].expand(len(anchor_index), -1)
    own_cols = None if own_columns_outside else anchor_index - start
    if columns.include_negatives and columns.positives and kept_negatives is None:
        # every column but (maybe) the anchor's own: no key comparison needed
        return Columns(width, invalid, None if columns.self_column else own_cols)
    negatives = columns == columns.negatives
    if (negatives or columns == columns.positives_only) and kept_negatives is None \
            and buffer is not None and invalid is None and keys.is_floating_point():
        # 1.0 where the keys match (negatives) or differ (positives, and the own column by
        # index): a CPU writes a float mask several times faster than a bool one
        compare = torch.eq if negatives else torch.ne
        return Columns(width, compare(anchor_keys[:, None], keys[None, :],
                                      out=buffer(len(anchor_keys), width)),
                       None if negatives else own_cols)
    if negatives and kept_negatives is None:
        drop = anchor_keys[:, None] == keys[None, :]  # the anchor's own column shares its key
    else:
        same = anchor_keys[:, None] == keys[None, :]
        cols = torch.arange(start, start + width, device=keys.device)
        is_self = anchor_index[:, None] == cols[None, :]
        keep = torch.zeros_like(same)
        if columns.include_negatives:
            keep = ~same if kept_negatives is None else ~same & kept_negatives
        if columns.positives:
            keep = keep | (same & ~is_self)
        if columns.self_column:
            keep = keep | is_self
        drop = ~keep
    return Columns(width, drop if invalid is None else drop | invalid)


def float_keys(keys: Tensor, bound: int) -> Tensor:
    """[N] float keys equal where ``keys`` (integers in [0, ``bound``), such as group slots)
    are: float32 while it holds every such integer exactly, else float64."""
    return keys.to(torch.float32 if bound <= 2**24 else torch.float64)


@dataclass(frozen=True)
class ColumnTiles:
    """One :class:`ColumnSet` cut into column tiles [start, stop): each tile's
    :class:`Columns`, relative to the tile, from the keys (anchor keys [n], candidate keys
    [N]) without building the [n, N] set; under a negatives subset, with the per-row
    ``threshold`` [n] on :func:`subset_scores`; ``valid`` [N] leaves out padding columns.
    ``anchor_start`` is set when ``anchor_index`` is a known range [anchor_start,
    anchor_start + n): a tile then skips the own-column step where no anchor's column lies."""

    columns: ColumnSet
    anchor_index: Tensor
    anchor_keys: Tensor
    keys: Tensor
    threshold: Tensor | None = None
    seed: int = 0
    valid: Tensor | None = None
    positions: Tensor | None = None  # [N] places among the real rows (subset_scores)
    anchor_start: int | None = None

    def tile(self, start: int, stop: int, rows: slice = slice(None),
             buffer: Buffer | None = None) -> Columns:
        """The :class:`Columns` of candidate columns [start, stop) for the anchor ``rows``
        (a block of rows, contiguous), relative to the block; ``buffer`` as in
        :func:`column_mask`."""
        anchor_index = self.anchor_index[rows]
        subset = None
        if self.threshold is not None and self.columns.include_negatives:
            cols = torch.arange(start, stop, device=anchor_index.device)
            scores = subset_scores(self.seed, anchor_index, cols, len(self.keys),
                                   self.positions)
            subset = scores <= self.threshold[rows, None]
        return column_mask(self.columns, anchor_index, self.anchor_keys[rows],
                           self.keys[start:stop], start, subset,
                           None if self.valid is None else self.valid[start:stop], buffer,
                           self._own_columns_outside(start, stop, rows))

    def _own_columns_outside(self, start: int, stop: int, rows: slice) -> bool:
        """Whether no anchor of ``rows`` has its own column in [start, stop), as far as the
        host knows without reading the device."""
        if self.anchor_start is None:
            return False
        block = range(len(self.anchor_index))[rows]
        first, end = self.anchor_start + block.start, self.anchor_start + block.stop
        return end <= start or stop <= first


def subset_threshold(seed: int, anchor_index: Tensor, anchor_keys: Tensor, keys: Tensor,
                     k: int, tile_size: int, valid: Tensor | None = None,
                     positions: Tensor | None = None) -> Tensor:
    """[n] the k-th smallest :func:`subset_scores` among each row's negatives (the largest
    one if a row has fewer; ``valid`` [N] leaves padding columns out), found tile by tile
    with a running top-k: O(n (k + T))."""
    best = torch.full((len(anchor_index), 0), NOT_A_NEGATIVE, dtype=torch.long,
                      device=anchor_index.device)
    for start in range(0, len(keys), tile_size):
        cols = torch.arange(start, min(start + tile_size, len(keys)), device=keys.device)
        scores = subset_scores(seed, anchor_index, cols, len(keys), positions)
        not_negative = anchor_keys[:, None] == keys[None, cols]
        if valid is not None:
            not_negative |= ~valid[None, cols]
        scores.masked_fill_(not_negative, NOT_A_NEGATIVE)
        merged = torch.cat([best, scores], dim=1)
        best = merged.topk(min(k, merged.shape[1]), dim=1, largest=False).values
    return best.max(dim=1).values
