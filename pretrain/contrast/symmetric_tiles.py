"""The tiled pass of ``tiles.py`` over a problem that is its own transpose: every candidate
is an anchor in its own row, each mask keeps (i, j) iff it keeps (j, i), and the target
logits are symmetric (X-CLR's caption cosines, u_ij = u_ji).

The N rows are cut into square blocks and only the tile pairs (r, c) with r <= c are
visited: each tile's logits l = a_r . a_c / tau and targets u are computed once and read
along their rows, for the anchors of r, and down their columns, for the anchors of c. The
forward folds both readings into one running log-sum-exp per row (with the target term
and the monitors over the negatives, as ``tiles._forward_block``); the backward forms
d loss / d l of both readings in one [r, c] tile H = G_rc + G_cr^T and adds H a_c to the
rows of r and H^T a_r to those of c. The products with the embeddings and with the
captions, which dominate a tiled X-CLR step, are made half as often as by the row-by-row
walk, and the elementwise work is the same. CPU only: a square tile holds no more than
one of the row walk's [rows, T] tiles.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import torch
from torch import Tensor

from pretrain.contrast.columns import MASKED_LOGIT, Columns
from pretrain.contrast.tiles import (
    TileBuffers,
    TiledRows,
    TilePlan,
    _PassSums,
    _tiled_rows,
    divided,
    row_blocks,
)


def square_blocks(n: int, tile_size: int) -> list[slice]:
    """The rows in blocks whose square tiles hold no more than the row walk's [rows, T]
    tiles (``tiles.row_blocks``): the memory ``objective.tile_size`` bounds stays bounded."""
    rows = min(n, row_blocks(n, tile_size, torch.device("cpu"))[0].stop)
    side = max(1, min(n, math.isqrt(rows * min(tile_size, n))))
    return [slice(start, min(start + side, n)) for start in range(0, n, side)]


def _buffers(columns: Tensor, plan: TilePlan) -> TileBuffers:
    """Buffers of one square tile."""
    side = square_blocks(columns.shape[0], plan.tile_size)[0].stop
    return TileBuffers(columns, plan.tile_size, elements=side * side)


def _tile_pairs(columns: Tensor, plan: TilePlan, temperature: float | Tensor,
                scratch: TileBuffers, with_targets: bool,
                ) -> Iterator[tuple[slice, slice, Tensor, Tensor | None]]:
    """(rows r, rows c, masked logits [r, c], masked targets or None) for
    every block pair r <= c, in the scratch buffers (each pair's overwrites the last's)."""
    blocks = square_blocks(columns.shape[0], plan.tile_size)
    for i, r in enumerate(blocks):
        anchors = divided(columns[r], temperature)
        for c in blocks[i:]:
            shape = (r.stop - r.start, c.stop - c.start)
            mask = plan.columns.tile(c.start, c.stop, r, scratch["columns mask"])
            logits = mask.fill_(torch.mm(anchors, columns[c].T, out=scratch["logits"](*shape)),
                                MASKED_LOGIT)
            targets = None
            if with_targets:
                targets = mask.fill_(plan.targets(c.start, c.stop, r,
                                                  scratch["targets"](*shape)), MASKED_LOGIT)
            yield r, c, logits, targets


class _RunningRows:
    """Per row of the N: the online log-sum-exp of its logits, of its targets, the target
    term and cross term (rescaled with the targets' maximum) and the negatives' ESS sums."""

    def __init__(self, n: int, like: Tensor) -> None:
        self.top, self.target_top = (like.new_full((n,), MASKED_LOGIT) for _ in range(2))
        (self.total, self.target_total, self.term, self.cross, self.neg_sum,
         self.neg_sq) = (like.new_zeros(n) for _ in range(6))

    def fold(self, rows: slice, dim: int, logits: Tensor, targets: Tensor | None,
             negatives: Columns | None, plan: TilePlan, scratch: TileBuffers) -> None:
        """Fold in a tile read along its rows (``dim`` 1) or down its columns (0) for
        ``rows``; ``negatives``: the tile's negatives mask when it is not the columns'."""
        spread: Callable[[Tensor], Tensor] = (lambda v: v[:, None]) if dim == 1 else \
            (lambda v: v[None, :])
        top = torch.maximum(self.top[rows], logits.amax(dim))
        scale = torch.exp(self.top[rows] - top)
        weights = torch.sub(logits, spread(top), out=scratch["weights"](*logits.shape)).exp_()
        self.total[rows] = self.total[rows] * scale + weights.sum(dim)
        self.top[rows] = top
        if plan.negatives is not None:
            if negatives is not None:
                weights = negatives.fill_(weights, 0.0)
            self.neg_sum[rows] = self.neg_sum[rows] * scale + weights.sum(dim)
            self.neg_sq[rows] = self.neg_sq[rows] * scale.square() + torch.linalg.vector_norm(
                weights, dim=dim).square()
        if targets is None:
            return
        top = torch.maximum(self.target_top[rows], targets.amax(dim))
        scale = torch.exp(self.target_top[rows] - top)
        weights = torch.sub(targets, spread(top),
                            out=scratch["target weights"](*targets.shape)).exp_()
        product = scratch["temporary"](*targets.shape)
        self.term[rows] = self.term[rows] * scale + torch.mul(weights, logits,
                                                              out=product).sum(dim)
        self.cross[rows] = self.cross[rows] * scale + torch.mul(weights, targets,
                                                                out=product).sum(dim)
        self.target_total[rows] = self.target_total[rows] * scale + weights.sum(dim)
        self.target_top[rows] = top

    def sums(self, has_targets: bool) -> _PassSums:
        lse, empty = self.top + torch.log(self.total), self.top.new_zeros(0)
        term = target_lse = entropy = empty
        if has_targets:
            target_lse = self.target_top + torch.log(self.target_total)
            term = self.term / self.target_total
            entropy = target_lse - self.cross / self.target_total
        return _PassSums(lse, term, target_lse, entropy, self.neg_sum.square() / self.neg_sq,
                         torch.zeros_like(lse), empty, empty)


def _forward(columns: Tensor, plan: TilePlan, temperature: float | Tensor) -> _PassSums:
    scratch = _buffers(columns, plan)
    running = _RunningRows(columns.shape[0], columns)
    has_targets = plan.targets is not None
    for r, c, logits, targets in _tile_pairs(columns, plan, temperature, scratch,
                                                   has_targets):
        negatives = None
        if plan.negatives is not None and plan.negatives is not plan.columns:
            negatives = plan.negatives.tile(c.start, c.stop, r, scratch["negatives mask"])
        running.fold(r, 1, logits, targets, negatives, plan, scratch)
        if c != r:
            running.fold(c, 0, logits, targets, negatives, plan, scratch)
    return running.sums(has_targets)


def _tile_grads(values: Tensor, r: slice, c: slice, lse: Tensor, grad: Tensor,
                buffer: Tensor) -> Tensor:
    """d / d values of sum_i grad_i lse_i over both readings of a masked [r, c] tile
    (overwritten): grad_r softmax along the rows, plus grad_c softmax down the columns
    when c is another block."""
    if c != r:
        down = torch.sub(values, lse[c][None, :], out=buffer).exp_().mul_(grad[c][None, :])
    along = values.sub_(lse[r][:, None]).exp_().mul_(grad[r][:, None])
    return along if c == r else along.add_(down)


class _SymmetricTiledLogSumExp(torch.autograd.Function):
    """(lse [N], target term [N], monitors) of the logits ``columns @ columns.T /
    temperature`` under a symmetric ``plan``, every row an anchor."""

    @staticmethod
    def forward(ctx, columns: Tensor, temperature: float | Tensor,
                plan: TilePlan) -> tuple[Tensor, ...]:
        ctx.set_materialize_grads(False)
        sums = _forward(columns, plan, temperature)
        tau = temperature if isinstance(temperature, Tensor) else None
        ctx.plan, ctx.temperature = plan, temperature if tau is None else None
        ctx.save_for_backward(columns, tau, sums.lse, sums.target_lse)
        ctx.mark_non_differentiable(*sums[2:])
        return tuple(sums)

    @staticmethod
    def backward(ctx, grad_lse: Tensor | None, grad_term: Tensor | None,
                 *_: Tensor | None) -> tuple[Tensor | None, ...]:
        columns, tau, lse, target_lse = ctx.saved_tensors
        plan: TilePlan = ctx.plan
        if plan.targets is None:
            grad_term = None
        if grad_lse is None and grad_term is None:
            return None, None, None
        temperature = ctx.temperature if tau is None else tau
        # d l / d a = a' / tau: the row gradients carry the 1 / tau
        grad_lse, grad_term = (None if g is None else divided(g, temperature)
                               for g in (grad_lse, grad_term))
        grad = torch.zeros_like(columns)
        tau_sum = lse.new_zeros(()) if tau is not None and ctx.needs_input_grad[1] else None
        scratch = _buffers(columns, plan)
        for r, c, logits, targets in _tile_pairs(columns, plan, temperature, scratch,
                                                    grad_term is not None):
            buffer = scratch["by column"](*logits.shape)
            tile = None
            if grad_lse is not None:
                tile = _tile_grads(logits, r, c, lse, grad_lse, buffer)
            if targets is not None:  # d term / d l = t, along and down
                target = _tile_grads(targets, r, c, target_lse, grad_term, buffer)
                tile = target if tile is None else tile.add_(target)
            rows = torch.mm(tile, columns[c])  # [r, D] d loss / d a_r, not over tau
            grad[r] += rows
            grad[c].addmm_(tile.T, columns[r])
            if tau_sum is not None:  # d l_ij / d tau = -l_ij / tau
                tau_sum += torch.einsum("nd,nd->", columns[r], rows)
        grad_tau = None if tau_sum is None else -tau_sum / tau
        return grad if ctx.needs_input_grad[0] else None, grad_tau, None


def symmetric_rows(columns: Tensor, plan: TilePlan,
                   temperature: float | Tensor = 1.0) -> TiledRows:
    """``tiles.tiled_rows`` of every row of ``columns`` [N, D] against all of them under a
    symmetric ``plan``."""
    return _tiled_rows(plan, _PassSums(*_SymmetricTiledLogSumExp.apply(columns, temperature,
                                                                       plan)))
