"""Row reductions of the logits A @ B.T over column tiles, never building [n, N]
(``docs/negatives.md``).

The forward walks the N columns in tiles of T, keeping per row a running maximum and a
rescaled sum (the online log-sum-exp of Milakov & Gimelshein 2018, as in FlashAttention
and Inf-CL); the backward recomputes each tile's logits from the saved A [n, D], B [N, D]
and log-sum-exp [n], so memory is O((n + N) D + n T). Besides the log-sum-exp it can
carry, in the same pass, a soft-target term sum_j t_ij l_ij with t = softmax of target
logits over the same columns (X-CLR), and the monitors over the negatives (the ESS sums
and the negatives' logit sum) without gradient.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from pretrain.losses.columns import MASKED_LOGIT, ColumnTiles

# (start, stop, rows) -> [rows, stop - start] target logits of a block of anchor rows, no grad
TargetLogits = Callable[[int, int, slice], Tensor]
CPU_BLOCK_ELEMENTS = 2**18  # a CPU [rows, T] tile: 1 MiB of float32, about a core's L2


@dataclass(frozen=True)
class TilePlan:
    """What one tiled pass computes: ``columns`` of the log-sum-exp (and of the targets),
    optional ``targets`` logits, and optional monitors over the ``negatives``."""

    tile_size: int
    columns: ColumnTiles
    targets: TargetLogits | None = None
    negatives: ColumnTiles | None = None
    negative_logit_sum: bool = False


class TiledRows(NamedTuple):
    """Per-row results [n] of a tiled pass; entries a plan did not ask for are None."""

    lse: Tensor  # log sum_j exp l_ij over the columns (with gradient)
    target_term: Tensor | None  # sum_j t_ij l_ij (with gradient)
    target_entropy: Tensor | None  # -sum_j t_ij log t_ij
    ess_ratio: Tensor | None  # (sum_neg p)^2 / sum_neg p^2, p the softmax of the columns
    negative_logit_sum: Tensor | None  # sum over the negatives of l_ij


class _PassSums(NamedTuple):
    """Per-row [n] results of one forward pass, before :class:`TiledRows` drops what the
    plan did not ask for (those are empty or zero here)."""

    lse: Tensor
    target_term: Tensor
    target_lse: Tensor
    target_entropy: Tensor
    ess_ratio: Tensor
    negative_logit_sum: Tensor


class _Running:
    """Online log-sum-exp of one row set: max ``top`` [n] and sum of exp(x - top)."""

    def __init__(self, n: int, like: Tensor) -> None:
        self.top = like.new_full((n,), MASKED_LOGIT)
        self.total = like.new_zeros(n)

    def update(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Fold in x [n, T]; returns (exp(x - new top), the old sums' rescale factor)."""
        top = torch.maximum(self.top, x.amax(dim=1))
        scale = torch.exp(self.top - top)
        weights = torch.exp(x - top[:, None])
        self.total = self.total * scale + weights.sum(1)
        self.top = top
        return weights, scale

    def lse(self) -> Tensor:
        return self.top + torch.log(self.total)


def row_blocks(n: int, tile_size: int, device: torch.device) -> list[slice]:
    """Anchor rows in blocks whose [rows, T] tiles stay small on a CPU (in cache, and under
    glibc's mmap threshold, so temporaries are reused instead of page-faulted in per tile);
    one block on a GPU, whose caching allocator reuses memory and wants large matmuls."""
    size = n if device.type == "cuda" else max(1, CPU_BLOCK_ELEMENTS // tile_size)
    return [slice(start, min(start + size, n)) for start in range(0, n, size)]


def _forward_block(anchors: Tensor, columns: Tensor, plan: TilePlan,
                   block: slice) -> _PassSums:
    """The forward pass for one block of anchor rows (``anchors`` are that block's)."""
    n, num_columns = anchors.shape[0], columns.shape[0]
    rows = _Running(n, anchors)
    targets = _Running(n, anchors) if plan.targets is not None else None
    term = anchors.new_zeros(n)  # sum exp(target - top) * l, rescaled with the targets' top
    cross = anchors.new_zeros(n)  # sum exp(target - top) * target
    neg_sum, neg_sq = anchors.new_zeros(n), anchors.new_zeros(n)
    neg_logits = anchors.new_zeros(n)
    for start in range(0, num_columns, plan.tile_size):
        stop = min(start + plan.tile_size, num_columns)
        tile = plan.columns.tile(start, stop, block)
        logits = tile.fill_(anchors @ columns[start:stop].T, MASKED_LOGIT)
        weights, scale = rows.update(logits)
        if plan.negatives is not None:  # the negatives are a subset of the columns
            negatives = plan.negatives.tile(start, stop, block)
            neg_weights = negatives.fill_(weights, 0.0)
            neg_sum = neg_sum * scale + neg_weights.sum(1)
            neg_sq = neg_sq * scale.square() + torch.linalg.vecdot(neg_weights, neg_weights)
            if plan.negative_logit_sum:
                neg_logits += negatives.apply(logits, 0.0).sum(1)
        if targets is not None:
            target = tile.fill_(plan.targets(start, stop, block), MASKED_LOGIT)
            target_weights, target_scale = targets.update(target)
            term = term * target_scale + torch.linalg.vecdot(target_weights, logits)
            cross = cross * target_scale + torch.linalg.vecdot(target_weights, target)
    lse = rows.lse()
    target_lse, entropy = lse.new_zeros(0), lse.new_zeros(0)
    if targets is not None:
        target_lse = targets.lse()
        term, entropy = term / targets.total, target_lse - cross / targets.total
    return _PassSums(lse, term, target_lse, entropy, neg_sum.square() / neg_sq, neg_logits)


def _forward(anchors: Tensor, columns: Tensor, plan: TilePlan) -> _PassSums:
    blocks = [_forward_block(anchors[block], columns, plan, block)
              for block in row_blocks(anchors.shape[0], plan.tile_size, anchors.device)]
    return _PassSums(*(torch.cat(parts) for parts in zip(*blocks, strict=True)))


class _TiledLogSumExp(torch.autograd.Function):
    """(lse [n], target term [n]) of the logits ``anchors @ columns.T`` under ``plan``;
    the other outputs are monitors without gradient."""

    @staticmethod
    def forward(ctx, anchors: Tensor, columns: Tensor, plan: TilePlan) -> tuple[Tensor, ...]:
        ctx.set_materialize_grads(False)
        sums = _forward(anchors, columns, plan)
        ctx.plan = plan
        ctx.save_for_backward(anchors, columns, sums.lse, sums.target_lse)
        ctx.mark_non_differentiable(sums.target_lse, sums.target_entropy, sums.ess_ratio,
                                    sums.negative_logit_sum)
        return tuple(sums)  # autograd hands back plain tuples

    @staticmethod
    def backward(ctx, grad_lse: Tensor | None, grad_term: Tensor | None,
                 *_: None) -> tuple[Tensor | None, Tensor | None, None]:
        anchors, columns, lse, target_lse = ctx.saved_tensors
        plan: TilePlan = ctx.plan
        if grad_term is not None and plan.targets is None:
            grad_term = None
        if grad_lse is None and grad_term is None:
            return None, None, None
        grad_anchors = torch.zeros_like(anchors)
        grad_columns = torch.zeros_like(columns) if ctx.needs_input_grad[1] else None
        for block in row_blocks(anchors.shape[0], plan.tile_size, anchors.device):
            block_anchors = anchors[block]
            for start in range(0, columns.shape[0], plan.tile_size):
                stop = min(start + plan.tile_size, columns.shape[0])
                tile = plan.columns.tile(start, stop, block)
                part = columns[start:stop]
                grad_logits = block_anchors.new_zeros(block_anchors.shape[0], stop - start)
                if grad_lse is not None:  # d lse / d l = softmax
                    logits = tile.fill_(block_anchors @ part.T, MASKED_LOGIT)
                    grad_logits += torch.exp(logits - lse[block, None]).mul_(
                        grad_lse[block, None])
                if grad_term is not None:  # d term / d l = targets
                    target = tile.fill_(plan.targets(start, stop, block), MASKED_LOGIT)
                    grad_logits += torch.exp(target - target_lse[block, None]).mul_(
                        grad_term[block, None])
                grad_anchors[block] += grad_logits @ part
                if grad_columns is not None:
                    grad_columns[start:stop] += grad_logits.T @ block_anchors
        return grad_anchors, grad_columns, None


def tiled_rows(anchors: Tensor, columns: Tensor, plan: TilePlan) -> TiledRows:
    """Row reductions of ``anchors`` [n, D] @ ``columns`` [N, D].T under ``plan``."""
    sums = _PassSums(*_TiledLogSumExp.apply(anchors, columns, plan))
    has_targets = plan.targets is not None
    return TiledRows(
        lse=sums.lse,
        target_term=sums.target_term if has_targets else None,
        target_entropy=sums.target_entropy if has_targets else None,
        ess_ratio=sums.ess_ratio if plan.negatives is not None else None,
        negative_logit_sum=sums.negative_logit_sum if plan.negative_logit_sum else None,
    )


@dataclass(frozen=True)
class PositiveTiles:
    """Per tile, the [rows, T] mask of each anchor's positives (same key, not itself)."""

    tile_size: int
    anchor_index: Tensor  # [n]
    anchor_keys: Tensor  # [n]
    keys: Tensor  # [N]

    def tile(self, start: int, stop: int, rows: slice) -> Tensor:
        cols = torch.arange(start, stop, device=self.keys.device)
        return ((self.anchor_keys[rows, None] == self.keys[None, start:stop])
                & (self.anchor_index[rows, None] != cols[None, :]))


def _tile_pairs(positives: PositiveTiles, n: int, num_columns: int,
                device: torch.device) -> Iterator[tuple[Tensor, Tensor]]:
    """Each tile's positive pairs as global (rows [P_t], cols [P_t]): found with an
    [rows, T] mask, then handled as P_t dot products instead of a [rows, T] matmul."""
    for block in row_blocks(n, positives.tile_size, device):
        for start in range(0, num_columns, positives.tile_size):
            stop = min(start + positives.tile_size, num_columns)
            rows, cols = positives.tile(start, stop, block).nonzero(as_tuple=True)
            yield rows + block.start, cols + start


class _TiledPairTerms(torch.autograd.Function):
    """sum over positives p of softplus(lse_neg_i - l_ip + eps) - eps, per anchor [n]
    (SINCERE's pair terms), and the positives' log-sum-exp [n] without gradient. The
    positives of a tile are gathered and their logits taken as dot products: O(P D) in
    all, about 1/C of the logits' matmul for C classes."""

    @staticmethod
    def forward(ctx, anchors: Tensor, columns: Tensor, lse_neg: Tensor, eps: float,
                positives: PositiveTiles) -> tuple[Tensor, Tensor]:
        ctx.set_materialize_grads(False)
        n = anchors.shape[0]
        total = anchors.new_zeros(n)
        top, sums = anchors.new_full((n,), MASKED_LOGIT), anchors.new_zeros(n)
        for rows, cols in _tile_pairs(positives, n, columns.shape[0], anchors.device):
            logits = torch.linalg.vecdot(anchors[rows], columns[cols])  # [P_t]
            terms = torch.nn.functional.softplus(lse_neg[rows] - logits + eps) - eps
            total.index_add_(0, rows, terms)
            new_top = top.scatter_reduce(0, rows, logits, reduce="amax")
            sums = sums * torch.exp(top - new_top) + torch.zeros_like(sums).index_add_(
                0, rows, torch.exp(logits - new_top[rows]))
            top = new_top
        ctx.eps, ctx.positives = eps, positives
        ctx.save_for_backward(anchors, columns, lse_neg)
        pos_lse = top + torch.log(sums.clamp(min=torch.finfo(sums.dtype).tiny))
        ctx.mark_non_differentiable(pos_lse)
        return total, pos_lse

    @staticmethod
    def backward(ctx, grad_total: Tensor | None, _: None) -> tuple[Tensor | None, ...]:
        if grad_total is None:
            return None, None, None, None, None
        anchors, columns, lse_neg = ctx.saved_tensors
        grad_anchors, grad_columns = torch.zeros_like(anchors), torch.zeros_like(columns)
        grad_lse = torch.zeros_like(lse_neg)
        for rows, cols in _tile_pairs(ctx.positives, anchors.shape[0], columns.shape[0],
                                      anchors.device):
            logits = torch.linalg.vecdot(anchors[rows], columns[cols])
            # d total / d lse_neg = sigmoid(...) = -d total / d l, times the incoming grad
            slope = torch.sigmoid(lse_neg[rows] - logits + ctx.eps) * grad_total[rows]
            grad_lse.index_add_(0, rows, slope)
            grad_anchors.index_add_(0, rows, -slope[:, None] * columns[cols])
            grad_columns.index_add_(0, cols, -slope[:, None] * anchors[rows])
        return grad_anchors, grad_columns, grad_lse, None, None


def tiled_pair_terms(anchors: Tensor, columns: Tensor, lse_neg: Tensor, eps: float,
                     positives: PositiveTiles) -> tuple[Tensor, Tensor]:
    """([n] sum of SINCERE's pair terms with gradient, [n] positives' log-sum-exp)."""
    return _TiledPairTerms.apply(anchors, columns, lse_neg, eps, positives)
