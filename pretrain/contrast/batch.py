"""The description of one global batch that every objective reads.

Rows are this rank's anchors, columns are all candidates of the global batch (every rank's
samples, in rank order). One process on the whole batch is the special case
``anchor_index = arange(N)``, ``world_size = 1``; the gathering boundary builds the
distributed case, so both run the same objective code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Literal

import torch
from torch import Tensor

from pretrain.contrast.columns import (
    NOT_A_NEGATIVE,
    Columns,
    ColumnSet,
    ColumnTiles,
    PositiveKind,
    column_mask,
    float_keys,
    subset_scores,
    subset_threshold,
)

# Dense logits are faster up to this many candidates; tiles of AUTO_TILE_SIZE above
# (measured by bench/perf/negatives.py, docs/benchmarks.md).
DENSE_MAX_CANDIDATES = 8192
AUTO_TILE_SIZE = 256


def sum_by_group(rows: Tensor, groups: Tensor, num_groups: int) -> Tensor:
    """[G, D] the sums of ``rows`` [N, D] by ``groups`` [N]."""
    return rows.new_zeros(num_groups, rows.shape[1]).index_add_(0, groups, rows)


def auto_tile_size(tile_size: int | None, num_candidates: int) -> int | None:
    """The tile width to use: ``tile_size`` if set, else dense (None) up to
    ``DENSE_MAX_CANDIDATES`` candidates and ``AUTO_TILE_SIZE`` above."""
    if tile_size is not None:
        return tile_size
    return AUTO_TILE_SIZE if num_candidates > DENSE_MAX_CANDIDATES else None


@dataclass(frozen=True, eq=False)
class ContrastiveBatch:
    """One global batch as seen by one rank.

    Attributes:
        candidates: [N, D] L2-normalised embeddings of the global batch, carrying gradient.
        anchor_index: [n] long, positions of this rank's anchors among the candidates.
        ids: [N] long instance ids; the augmented views of one image share an id.
        labels: [N] long class labels, or None (then only instance positives exist).
        captions: [N, E] caption embeddings as given, or None: X-CLR takes their cosine,
            normalising a block of rows at a time (no normalised [N, E] copy).
        class_graph: [C, C] class-similarity matrix looked up by labels, or None.
        text: [N, D] L2-normalised second-modality embeddings (``clip``), or None.
        num_negatives: keep a seeded random subset of k negatives per anchor; None keeps all.
        negatives_seed: seed of that subset (vary it per step for fresh subsets).
        tile_size: compute the objective over column tiles of this width, never building
            an [n, N] tensor (``docs/negatives.md``); None computes it densely.
        world_size: number of ranks whose anchors partition the candidates; per-rank means
            are scaled by it so that gradient averaging across ranks gives the global mean.
        num_classes: C, labels lie in [0, C): label groups are the C classes (a class
            graph's C when it has one); None: groups found by sorting, N slots.
        valid: [N] bool, False at padding rows (a rank that held fewer rows than the
            others pads them so that every gather has one shape); None: every row is real.
            A padding row is no candidate, no anchor and no member of any group.
        anchor_start: set when ``anchor_index`` is the range [anchor_start, anchor_start +
            n), as every rank's is: ``anchors`` is then a view of those candidate rows, not
            an [n, D] copy.

    Every shape here follows from N, n and C, never from the values the batch holds, so
    no objective reads a value back to the host (``docs/training.md``).
    """

    candidates: Tensor
    anchor_index: Tensor
    ids: Tensor
    labels: Tensor | None = None
    captions: Tensor | None = None
    class_graph: Tensor | None = None
    text: Tensor | None = None
    num_negatives: int | None = None
    negatives_seed: int = 0
    tile_size: int | None = None
    world_size: int = 1
    num_classes: int | None = None
    valid: Tensor | None = None
    anchor_start: int | None = None
    _cache: dict = field(default_factory=dict, init=False, repr=False)

    @cached_property
    def anchors(self) -> Tensor:
        """[n, D] this rank's anchor embeddings (rows of ``candidates``)."""
        if self.anchor_start is not None:
            return self.candidates[self.anchor_start:self.anchor_start + len(self.anchor_index)]
        return self.candidates[self.anchor_index]

    @property
    def anchor_rows(self) -> slice | None:
        """The anchors' rows of ``candidates`` when they are a range (``anchor_start``)."""
        if self.anchor_start is None:
            return None
        return slice(self.anchor_start, self.anchor_start + len(self.anchor_index))

    @property
    def num_candidates(self) -> int:
        """N, the rows of the global batch (padding rows included)."""
        return self.candidates.shape[0]

    @cached_property
    def positions(self) -> Tensor | None:
        """[N] each row's place among the real rows (None without padding): what the
        negatives subset hashes, so that it does not depend on the padding."""
        return None if self.valid is None else self.valid.long().cumsum(0) - 1

    @property
    def num_valid(self) -> Tensor | int:
        """The real candidates among the N ([] on the device, or N without padding)."""
        return self.num_candidates if self.valid is None else self.valid.sum()

    def keys(self, kind: PositiveKind) -> Tensor:
        """[N] the key that defines positives: instance ids, or class labels."""
        if kind == "instance":
            return self.ids
        if self.labels is None:
            raise ValueError("label positives need class labels (labels=, an [N] tensor); "
                             "the batch has none")
        return self.labels

    def group_index(self, kind: PositiveKind) -> tuple[Tensor, Tensor, Tensor]:
        """([G] key of each group, [N] group of each candidate, [G] group sizes), G fixed by
        the shapes: label groups are the C classes when C is known (labels outside [0, C)
        fail on the device); otherwise G = N slots, the distinct keys in sorted order and
        then empty slots (size 0, key 0)."""
        if ("groups", kind) not in self._cache:
            keys = self.keys(kind)
            classes = self.classes if kind == "label" else None
            if classes is not None:
                torch._assert_async(((keys >= 0) & (keys < classes)).all(),
                                    f"labels must lie in [0, {classes}), the number of classes")
                values, groups = torch.arange(classes, device=keys.device), keys
            else:
                values, groups = _sorted_groups(keys)
            members = torch.ones_like(groups) if self.valid is None else self.valid.long()
            counts = torch.zeros(values.shape[0], dtype=torch.long, device=keys.device)
            counts.index_add_(0, groups, members)
            self._cache["groups", kind] = (values, groups, counts)
        return self._cache["groups", kind]

    @property
    def classes(self) -> int | None:
        """C, the number of classes labels index (``num_classes``, or the class graph's)."""
        if self.num_classes is not None:
            return self.num_classes
        return None if self.class_graph is None else self.class_graph.shape[0]

    def group_sums(self, kind: PositiveKind, of: Literal["candidates", "text"] = "candidates",
                   ) -> Tensor:
        """[G, D] sum of each group's candidate (or text) embeddings, float32 or float64,
        with gradient (when made under it). Not kept: a step that held it from its forward
        to the end of its backward would hold an [N, D]-sized tensor for nothing."""
        _, groups, counts = self.group_index(kind)
        rows = self.candidates if of == "candidates" else self.text
        rows = rows if rows.dtype in (torch.float32, torch.float64) else rows.float()
        return sum_by_group(rows, groups, counts.shape[0])

    def positive_mask(self, kind: PositiveKind) -> Tensor:
        """[n, N] bool: same key as the anchor, excluding the anchor itself."""
        return self.columns(ColumnSet(kind).positives_only).keep

    def negative_mask(self, kind: PositiveKind) -> Tensor:
        """[n, N] bool: the negatives each anchor uses (a seeded subset if num_negatives)."""
        return self.columns(ColumnSet(kind).negatives).keep

    def self_pairs(self) -> tuple[Tensor, Tensor]:
        """([n] rows, [n] columns) of each anchor's own column."""
        rows = torch.arange(self.anchor_index.shape[0], device=self.anchor_index.device)
        return rows, self.anchor_index

    def columns(self, columns: ColumnSet) -> Columns:
        """The dense :class:`Columns` of ``columns`` over [n, N]: each row's own column
        and/or an [n, N] mask from the keys (and the negatives subset), of fixed shape
        whatever the batch holds."""
        if ("columns", columns) not in self._cache:
            keys = self.keys(columns.kind)
            self._cache["columns", columns] = column_mask(
                columns, self.anchor_index, keys[self.anchor_index], keys, 0,
                self._subset(columns.kind), self.valid)
        return self._cache["columns", columns]

    def column_tiles(self, columns: ColumnSet) -> ColumnTiles:
        """``columns`` cut into column tiles of ``tile_size`` (:class:`ColumnTiles`)."""
        keys = self.keys(columns.kind)
        anchor_keys = keys[self.anchor_index]
        threshold = None
        if self.num_negatives is not None:
            if ("threshold", columns.kind) not in self._cache:
                self._cache["threshold", columns.kind] = subset_threshold(
                    self.negatives_seed, self.anchor_index, anchor_keys, keys,
                    self.num_negatives, self.tile_size or self.num_candidates, self.valid,
                    self.positions)
            threshold = self._cache["threshold", columns.kind]
        groups, slots, _ = self.group_index(columns.kind)
        slots = float_keys(slots, len(groups))  # equal where the keys are
        return ColumnTiles(columns, self.anchor_index, slots[self.anchor_index], slots,
                           threshold, self.negatives_seed, self.valid, self.positions,
                           self.anchor_start)

    def num_positives_per_anchor(self, kind: PositiveKind) -> Tensor:
        """[n] long: each anchor's positives of ``kind``, itself left out."""
        _, groups, counts = self.group_index(kind)
        return counts[groups[self.anchor_index]] - 1

    def num_negatives_per_anchor(self, kind: PositiveKind) -> Tensor:
        """[n] how many negatives each anchor's softmax holds: min(k, all of them)."""
        available = self.num_valid - 1 - self.num_positives_per_anchor(kind)
        if self.num_negatives is not None:
            available = available.clamp(max=self.num_negatives)
        return available

    def _subset(self, kind: PositiveKind) -> Tensor | None:
        """[n, N] bool: the k negatives of smallest :func:`subset_scores` per row (all if
        fewer); None when every negative is kept."""
        k = self.num_negatives
        if k is None or k >= self.num_candidates:
            return None
        if ("subset", kind) not in self._cache:
            keys = self.keys(kind)
            cols = torch.arange(self.num_candidates, device=self.candidates.device)
            scores = subset_scores(self.negatives_seed, self.anchor_index, cols, len(cols),
                                   self.positions)
            not_negative = keys[self.anchor_index][:, None] == keys[None, :]
            if self.valid is not None:
                not_negative |= ~self.valid[None, :]
            scores = scores.masked_fill(not_negative, NOT_A_NEGATIVE)
            chosen = scores.topk(k, dim=1, largest=False).indices
            kept = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
            self._cache["subset", kind] = kept.scatter_(1, chosen, True)
        return self._cache["subset", kind]

    def anchor_mean(self, values: Tensor, kind: PositiveKind | None,
                    need_negative: bool = False) -> Tensor:
        """Mean of per-anchor ``values`` [n] over qualifying anchors of the *global* batch.

        An anchor qualifies when it has a positive of ``kind`` (``None``: every anchor)
        and, with ``need_negative``, a negative. The count is taken over all N candidates,
        each of which is some rank's anchor, so no communication is needed; multiplying by
        ``world_size`` makes the mean over ranks of these per-rank values the global mean.
        """
        local, count = self._qualifying(kind, need_negative, values.device)
        return torch.where(local, values, torch.zeros_like(values)).sum() * self.world_size / count

    def anchor_weights(self, kind: PositiveKind | None, like: Tensor) -> Tensor:
        """[n] weights w (``like``'s dtype) with ``anchor_mean(values, kind)`` = sum_i w_i
        values_i for finite values: a reduction that weights its rows itself (SigLIP's tiles)
        can then hand back a scalar."""
        local, count = self._qualifying(kind, False, like.device)
        weight = like.new_full((), self.world_size) / count
        return torch.where(local, weight, like.new_zeros(()))

    def _qualifying(self, kind: PositiveKind | None, need_negative: bool,
                    device: torch.device) -> tuple[Tensor, Tensor]:
        """([n] whether each local anchor qualifies, 0-dim count of the global ones, >= 1)."""
        qualifies = torch.ones(self.num_candidates, dtype=torch.bool, device=device)
        if kind is not None:
            _, inverse, counts = self.group_index(kind)
            group_size = counts[inverse]
            qualifies = group_size >= 2
            if need_negative:
                qualifies &= group_size < self.num_valid
        if self.valid is not None:
            qualifies &= self.valid
        return qualifies[self.anchor_index], qualifies.sum().clamp(min=1)


def _sorted_groups(keys: Tensor) -> tuple[Tensor, Tensor]:
    """([N] distinct keys in sorted order then 0s, [N] slot of each key's group): a sort
    and a running count, with no value read back to the host (``torch.unique`` would)."""
    ordered, order = keys.sort(stable=True)
    starts = torch.ones_like(ordered, dtype=torch.bool)
    starts[1:] = ordered[1:] != ordered[:-1]
    slot = starts.long().cumsum(0) - 1  # [N] group of each sorted key
    groups = torch.empty_like(slot).scatter_(0, order, slot)
    values = torch.zeros_like(keys).scatter_(0, slot, ordered)  # equal keys write one value
    return values, groups


@dataclass(frozen=True)
class BatchRows:
    """The rows one process contributes to a global batch, before normalising and
    gathering: ``z`` [n, D] embeddings, ``ids`` [n] instance ids (the views of one image
    share one), optional ``labels`` [n], ``captions`` [n, E] caption embeddings and
    ``text`` [n, D] second-modality embeddings (clip, siglip)."""

    z: Tensor
    ids: Tensor
    labels: Tensor | None = None
    captions: Tensor | None = None
    text: Tensor | None = None


@dataclass(frozen=True)
class BatchOptions:
    """How an objective sees the global batch: ``class_graph`` [C, C] (xclr), a seeded
    subset of ``num_negatives`` negatives per anchor, ``tile_size`` (None: dense up to
    ``DENSE_MAX_CANDIDATES`` candidates, tiles above), ``num_classes`` C (labels in
    [0, C); None: label groups found by sorting) and ``rows_per_rank``, the rows every
    rank contributes to a gather (fewer are padded; None: its own, equal on every rank)."""

    class_graph: Tensor | None = None
    num_negatives: int | None = None
    negatives_seed: int = 0
    tile_size: int | None = None
    num_classes: int | None = None
    rows_per_rank: int | None = None


NORM_EPS = 1e-12  # F.normalize's


class _UnitRows(torch.autograd.Function):
    """y = x / max(||x||, eps) per row, as ``F.normalize``; written out because its
    backward, dx = (dy - y (dy . y)) / max(||x||, eps), then makes one [N, D] tensor where
    autograd's walk through the division and the norm makes eight with torch 2.15
    (``docs/negatives.md``)."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        norms = torch.linalg.vector_norm(x, dim=1, keepdim=True).clamp_(min=NORM_EPS)
        y = x / norms
        ctx.save_for_backward(y, norms)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor) -> Tensor:
        y, norms = ctx.saved_tensors
        along = torch.einsum("nd,nd->n", grad, y)[:, None]  # [N, 1], no [N, D] product
        along.masked_fill_(norms <= NORM_EPS, 0.0)  # clamped rows: x / eps, no norm term
        return torch.addcmul(grad, y, along, value=-1).div_(norms)


def unit_rows(x: Tensor) -> Tensor:
    """[N, D] rows of ``x`` scaled to unit L2 norm (zero rows stay zero), with gradient."""
    return _UnitRows.apply(x)


def local_batch(rows: BatchRows, options: BatchOptions = BatchOptions()) -> ContrastiveBatch:
    """A single-process :class:`ContrastiveBatch` over ``rows`` (every row an anchor);
    ``z`` and ``text`` are L2-normalised here."""
    return ContrastiveBatch(
        candidates=unit_rows(rows.z),
        anchor_index=torch.arange(rows.z.shape[0], device=rows.z.device),
        anchor_start=0,
        ids=rows.ids,
        labels=rows.labels,
        captions=rows.captions,
        class_graph=options.class_graph,
        text=None if rows.text is None else unit_rows(rows.text),
        num_negatives=options.num_negatives,
        negatives_seed=options.negatives_seed,
        tile_size=auto_tile_size(options.tile_size, rows.z.shape[0]),
        num_classes=options.num_classes,
    )
