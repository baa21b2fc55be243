"""Row reductions of the logits A @ B.T over column tiles, never building [n, N]
(``docs/negatives.md``).

The forward walks the N columns in tiles of T, keeping per row a running maximum and a
rescaled sum (the online log-sum-exp of Milakov & Gimelshein 2018, as in FlashAttention
and Inf-CL); the backward recomputes each tile's logits from the saved A [n, D], B [N, D]
and log-sum-exp [n], so memory is O((n + N) D + n T). Besides the log-sum-exp it can
carry, in the same pass, a soft-target term sum_j t_ij l_ij with t = softmax of target
logits over the same columns (X-CLR), the monitors over the negatives (the ESS sums and
the negatives' logit sum) without gradient, and the log-sum-exp of each column over the
rows (the transposed logits' rows: CLIP's second direction when the anchors are every
column's own row), so that one walk of the tiles serves both.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from pretrain.contrast.columns import MASKED_LOGIT, NEGLIGIBLE_LOG_WEIGHT, Buffer, ColumnTiles

# (start, stop, rows, out) -> the [rows, stop - start] target logits of a block of anchor
# rows, written into ``out`` (the same shape) and returned; no grad
TargetLogits = Callable[[int, int, slice, Tensor], Tensor]
# a CPU [rows, T] tile: 2 MiB of float32, split over two cores' L2 (measured against
# 1 and 4 MiB on a 2-core EPYC, docs/benchmarks.md)
CPU_BLOCK_ELEMENTS = 2**19


@dataclass(frozen=True)
class TilePlan:
    """What one tiled pass computes: ``columns`` of the log-sum-exp (and of the targets),
    optional ``targets`` logits, and optional monitors over the ``negatives`` (``columns``
    itself when they are the same set: the pass then reuses the columns' mask)."""

    tile_size: int
    columns: ColumnTiles
    targets: TargetLogits | None = None
    negatives: ColumnTiles | None = None
    negative_logit_sum: bool = False
    positives: ColumnTiles | None = None  # a log-sum-exp over these columns, no gradient
    # also log sum_i exp l_ij per column j (with gradient): the anchors must be the N
    # columns' own rows in order and ``columns`` symmetric (kept (i, j) iff kept (j, i))
    column_lse: bool = False
    # the problem is its own transpose (every column's own row an anchor, symmetric masks
    # and targets): one walk of the tile pairs r <= c serves both (``symmetric_tiles.py``)
    symmetric: bool = False


class TiledRows(NamedTuple):
    """Per-row results [n] of a tiled pass; entries a plan did not ask for are None."""

    lse: Tensor  # log sum_j exp l_ij over the columns (with gradient)
    target_term: Tensor | None  # sum_j t_ij l_ij (with gradient)
    target_entropy: Tensor | None  # -sum_j t_ij log t_ij
    ess_ratio: Tensor | None  # (sum_neg p)^2 / sum_neg p^2, p the softmax of the columns
    negative_logit_sum: Tensor | None  # sum over the negatives of l_ij
    positive_lse: Tensor | None  # log sum over the plan's positives of exp l_ij
    column_lse: Tensor | None  # [N] log sum_i exp l_ij over each column's kept rows


class _PassSums(NamedTuple):
    """Per-row [n] results of one forward pass, before :class:`TiledRows` drops what the
    plan did not ask for (those are empty or zero here)."""

    lse: Tensor
    target_term: Tensor
    target_lse: Tensor
    target_entropy: Tensor
    ess_ratio: Tensor
    negative_logit_sum: Tensor
    positive_lse: Tensor
    column_lse: Tensor


class TileBuffers:
    """Named float buffers of [rows, T] tiles, each allocated once per pass, when first
    used, and reused by every tile of every row block: per-tile temporaries, freed and
    allocated again hundreds of times, leave blocks that glibc keeps resident
    (``docs/benchmarks.md``, tiled memory)."""

    def __init__(self, anchors: Tensor, tile_size: int, elements: int | None = None) -> None:
        """Buffers of [rows, T] for ``anchors`` walked in tiles of ``tile_size`` columns, or
        of ``elements`` each."""
        rows = min(len(anchors), _block_rows(len(anchors), tile_size, anchors.device))
        self._like, self._numel = anchors, elements or rows * tile_size
        self._buffers: dict[str, Tensor] = {}

    def __getitem__(self, name: str) -> Buffer:
        """Buffer ``name`` as a contiguous [rows, width] tensor (width <= T)."""
        def view(rows: int, width: int) -> Tensor:
            if name not in self._buffers:
                self._buffers[name] = self._like.new_empty(self._numel)
            return self._buffers[name][:rows * width].view(rows, width)
        return view


class _Running:
    """Online log-sum-exp of one row set: max ``top`` [n] and sum of exp(x - top).

    ``sparse``: most entries are masked. Their x - top is then raised to
    ``NEGLIGIBLE_LOG_WEIGHT`` before the exp (``columns.py``).
    """

    def __init__(self, n: int, like: Tensor, sparse: bool = False) -> None:
        self.top = like.new_full((n,), MASKED_LOGIT)
        self.total = like.new_zeros(n)
        self.sparse = sparse

    def update(self, x: Tensor, out: Tensor) -> tuple[Tensor, Tensor]:
        """Fold in x [n, T]; returns (exp(x - new top) in ``out`` [n, T], the old sums'
        rescale factor)."""
        top = torch.maximum(self.top, x.amax(dim=1))
        scale = torch.exp(self.top - top)
        shifted = torch.sub(x, top[:, None], out=out)
        weights = (shifted.clamp_(min=NEGLIGIBLE_LOG_WEIGHT) if self.sparse else shifted).exp_()
        self.total = self.total * scale + weights.sum(1)
        self.top = top
        return weights, scale

    def lse(self) -> Tensor:
        return self.top + torch.log(self.total)


class _RunningColumns(_Running):
    """Online log-sum-exp of each of N columns over the row blocks that reach it."""

    def update_columns(self, start: int, x: Tensor, out: Tensor) -> None:
        """Fold in x [rows, T], the rows of one block at columns [start, start + T)."""
        columns = slice(start, start + x.shape[1])
        top = torch.maximum(self.top[columns], x.amax(dim=0))
        weights = torch.sub(x, top, out=out).exp_().sum(0)
        self.total[columns] = self.total[columns] * torch.exp(self.top[columns] - top) + weights
        self.top[columns] = top


def row_blocks(n: int, tile_size: int, device: torch.device) -> list[slice]:
    """Anchor rows in blocks whose [rows, T] tiles stay small on a CPU (in cache, and under
    glibc's mmap threshold, so temporaries are reused instead of page-faulted in per tile);
    one block on a GPU, whose caching allocator reuses memory and wants large matmuls."""
    size = _block_rows(n, tile_size, device)
    return [slice(start, min(start + size, n)) for start in range(0, n, size)]


def _block_rows(n: int, tile_size: int, device: torch.device) -> int:
    return n if device.type == "cuda" else max(1, CPU_BLOCK_ELEMENTS // tile_size)


def _forward_block(anchors: Tensor, columns: Tensor, plan: TilePlan, block: slice,
                   scratch: TileBuffers, by_column: _RunningColumns | None) -> _PassSums:
    """The forward pass for one block of anchor rows (``anchors`` are that block's);
    ``by_column`` folds in the block's rows of every column."""
    n, num_columns = anchors.shape[0], columns.shape[0]
    rows = _Running(n, anchors)
    targets = _Running(n, anchors) if plan.targets is not None else None
    positives = _Running(n, anchors, sparse=True) if plan.positives is not None else None
    term = anchors.new_zeros(n)  # sum exp(target - top) * l, rescaled with the targets' top
    cross = anchors.new_zeros(n)  # sum exp(target - top) * target
    neg_sum, neg_sq = anchors.new_zeros(n), anchors.new_zeros(n)
    neg_logits = anchors.new_zeros(n)
    for start in range(0, num_columns, plan.tile_size):
        stop = min(start + plan.tile_size, num_columns)
        shape = (n, stop - start)
        tile = plan.columns.tile(start, stop, block, scratch["columns mask"])
        logits = torch.mm(anchors, columns[start:stop].T, out=scratch["logits"](*shape))
        if positives is not None:  # before the columns' mask leaves positives out
            kept = plan.positives.tile(start, stop, block, scratch["positives mask"]).fill_(
                scratch["temporary"](*shape).copy_(logits), MASKED_LOGIT)
            positives.update(kept, out=kept)
        tile.fill_(logits, MASKED_LOGIT)
        if by_column is not None:
            by_column.update_columns(start, logits, out=scratch["temporary"](*shape))
        weights, scale = rows.update(logits, out=scratch["weights"](*shape))
        if plan.negatives is not None:  # the negatives are a subset of the columns
            if plan.negatives is plan.columns:  # their mask left exp(MASKED_LOGIT - top) = 0
                negatives, neg_weights = tile, weights
            else:
                negatives = plan.negatives.tile(start, stop, block, scratch["negatives mask"])
                neg_weights = negatives.fill_(weights, 0.0)
            neg_sum = neg_sum * scale + neg_weights.sum(1)
            # the norm reads the tile once, where a product would also write one
            neg_sq = neg_sq * scale.square() + torch.linalg.vector_norm(neg_weights,
                                                                        dim=1).square()
            if plan.negative_logit_sum:
                neg_logits += negatives.fill_(scratch["temporary"](*shape).copy_(logits),
                                              0.0).sum(1)
        if targets is not None:
            target = tile.fill_(plan.targets(start, stop, block, scratch["targets"](*shape)),
                                MASKED_LOGIT)
            target_weights, target_scale = targets.update(target,
                                                          out=scratch["target weights"](*shape))
            term = term * target_scale + _row_dot(target_weights, logits,
                                                  scratch["temporary"](*shape))
            cross = cross * target_scale + _row_dot(target_weights, target,
                                                    scratch["temporary"](*shape))
    lse = rows.lse()
    target_lse, entropy = lse.new_zeros(0), lse.new_zeros(0)
    if targets is not None:
        target_lse = targets.lse()
        term, entropy = term / targets.total, target_lse - cross / targets.total
    pos_lse = positives.lse() if positives is not None else lse.new_zeros(0)
    return _PassSums(lse, term, target_lse, entropy, neg_sum.square() / neg_sq, neg_logits,
                     pos_lse, lse.new_zeros(0))


def _row_dot(a: Tensor, b: Tensor, out: Tensor) -> Tensor:
    """[n] sum_j a_ij b_ij of [n, T] tiles, the products in ``out`` (``linalg.vecdot``
    would allocate them)."""
    return torch.mul(a, b, out=out).sum(1)


def _forward(anchors: Tensor, columns: Tensor, plan: TilePlan,
             temperature: float | Tensor = 1.0) -> _PassSums:
    scratch = TileBuffers(anchors, plan.tile_size)
    by_column = _RunningColumns(columns.shape[0], anchors) if plan.column_lse else None
    blocks = [_forward_block(divided(anchors[block], temperature), columns, plan, block, scratch,
                             by_column)
              for block in row_blocks(anchors.shape[0], plan.tile_size, anchors.device)]
    sums = _PassSums(*(torch.cat(parts) for parts in zip(*blocks, strict=True)))
    return sums if by_column is None else sums._replace(column_lse=by_column.lse())


def divided(rows: Tensor, temperature: float | Tensor) -> Tensor:
    """``rows`` / ``temperature``: a copy (the rows themselves at a temperature of 1)."""
    if isinstance(temperature, float | int) and temperature == 1:
        return rows
    return rows / temperature


class _TiledLogSumExp(torch.autograd.Function):
    """(lse [n], target term [n]) of the logits ``anchors @ columns.T / temperature`` under
    ``plan``; the other outputs are monitors without gradient. ``anchors`` is None when
    they are the rows ``anchor_rows`` of ``columns``: their gradient is then added into the
    columns' own, so the backward holds one [N, D] gradient, and the anchors over the
    temperature exist one row block at a time (no [n, D] copy is saved)."""

    @staticmethod
    def forward(ctx, anchors: Tensor | None, columns: Tensor, temperature: float | Tensor,
                plan: TilePlan, anchor_rows: slice | None) -> tuple[Tensor, ...]:
        ctx.set_materialize_grads(False)
        sums = _forward(columns[anchor_rows] if anchors is None else anchors, columns, plan,
                        temperature)
        ctx.plan, ctx.anchor_rows = plan, anchor_rows
        tau = temperature if isinstance(temperature, Tensor) else None
        ctx.temperature = temperature if tau is None else None
        ctx.save_for_backward(anchors, columns, tau, sums.lse, sums.target_lse, sums.column_lse)
        ctx.mark_non_differentiable(sums.target_lse, sums.target_entropy, sums.ess_ratio,
                                    sums.negative_logit_sum, sums.positive_lse)
        return tuple(sums)  # autograd hands back plain tuples

    @staticmethod
    def backward(ctx, grad_lse: Tensor | None, grad_term: Tensor | None,
                 *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        anchors, columns, tau, lse, target_lse, column_lse = ctx.saved_tensors
        plan: TilePlan = ctx.plan
        if grad_term is not None and plan.targets is None:
            grad_term = None
        grad_column = grads[-1] if plan.column_lse else None
        if grad_lse is None and grad_term is None and grad_column is None:
            return None, None, None, None, None
        temperature = ctx.temperature if tau is None else tau
        rows_of_columns = anchors is None
        anchors = columns[ctx.anchor_rows] if rows_of_columns else anchors
        grad_columns = torch.zeros_like(columns) if ctx.needs_input_grad[1] else None
        grad_anchors = None
        if not rows_of_columns and ctx.needs_input_grad[0]:
            grad_anchors = torch.zeros_like(anchors)
        tau_sum = lse.new_zeros(()) if tau is not None and ctx.needs_input_grad[2] else None
        # d l / d a = c / tau: the per-row and per-column gradients carry the 1 / tau
        grad_lse, grad_term, grad_column = (None if grad is None else divided(grad, temperature)
                                            for grad in (grad_lse, grad_term, grad_column))
        scratch = TileBuffers(anchors, plan.tile_size)
        for block in row_blocks(anchors.shape[0], plan.tile_size, anchors.device):
            raw = anchors[block]
            block_anchors, n = divided(raw, temperature), raw.shape[0]
            # d loss / d anchors of the block (not over tau): its own rows, or a block's
            block_grad = grad_anchors[block] if grad_anchors is not None else torch.zeros_like(raw)
            for start in range(0, columns.shape[0], plan.tile_size):
                stop = min(start + plan.tile_size, columns.shape[0])
                shape = (n, stop - start)
                tile = plan.columns.tile(start, stop, block, scratch["columns mask"])
                part = columns[start:stop]
                grad_logits = None
                if grad_lse is not None or grad_column is not None:
                    grad_logits = _softmax_grads(
                        tile.fill_(torch.mm(block_anchors, part.T, out=scratch["logits"](*shape)),
                                   MASKED_LOGIT),
                        (lse[block], grad_lse[block] if grad_lse is not None else None),
                        (column_lse[start:stop], grad_column[start:stop]
                         if grad_column is not None else None), scratch["by column"])
                if grad_term is not None:  # d term / d l = targets
                    target = tile.fill_(plan.targets(start, stop, block,
                                                     scratch["targets"](*shape)), MASKED_LOGIT)
                    target.sub_(target_lse[block, None]).exp_().mul_(grad_term[block, None])
                    grad_logits = target if grad_logits is None else grad_logits.add_(target)
                block_grad.addmm_(grad_logits, part)
                if grad_columns is not None:
                    grad_columns[start:stop].addmm_(grad_logits.T, raw)
            if tau_sum is not None:  # d l_ij / d tau = -l_ij / tau: -(a_i . grad_i) / tau
                tau_sum += torch.einsum("nd,nd->", raw, block_grad)
            if rows_of_columns and grad_columns is not None:
                start = ctx.anchor_rows.start or 0
                grad_columns[start + block.start:start + block.stop] += block_grad
        grad_tau = None if tau_sum is None else -tau_sum / tau
        return (None if rows_of_columns else grad_anchors), grad_columns, grad_tau, None, None


def _softmax_grads(logits: Tensor, by_row: tuple[Tensor, Tensor | None],
                   by_column: tuple[Tensor, Tensor | None],
                   buffer: Buffer) -> Tensor | None:
    """d / d l of sum_i g_i lse_i (rows) + sum_j h_j lse_j (columns) over a [rows, T] tile
    of ``logits`` (overwritten): g_i softmax_j + h_j softmax_i, each (lse, grad) pair's
    grad None where it has none."""
    (row_lse, row_grad), (column_lse, column_grad) = by_row, by_column
    per_column = None
    if column_grad is not None:
        per_column = torch.sub(logits, column_lse, out=buffer(*logits.shape))
        per_column.exp_().mul_(column_grad)
    if row_grad is None:
        return per_column
    per_row = logits.sub_(row_lse[:, None]).exp_().mul_(row_grad[:, None])
    return per_row if per_column is None else per_row.add_(per_column)


def tiled_rows(anchors: Tensor | None, columns: Tensor, plan: TilePlan,
               temperature: float | Tensor = 1.0,
               anchor_rows: slice | None = None) -> TiledRows:
    """Row reductions of ``anchors`` [n, D] @ ``columns`` [N, D].T / ``temperature`` under
    ``plan``; ``anchors`` None: they are ``columns[anchor_rows]`` (one gradient buffer)."""
    if (anchors is None) != (anchor_rows is not None):
        raise ValueError("tiled_rows: give the anchors, or the columns' rows they are")
    return _tiled_rows(plan, _PassSums(*_TiledLogSumExp.apply(anchors, columns, temperature,
                                                              plan, anchor_rows)))


def _tiled_rows(plan: TilePlan, sums: _PassSums) -> TiledRows:
    has_targets = plan.targets is not None
    return TiledRows(
        lse=sums.lse,
        target_term=sums.target_term if has_targets else None,
        target_entropy=sums.target_entropy if has_targets else None,
        ess_ratio=sums.ess_ratio if plan.negatives is not None else None,
        negative_logit_sum=sums.negative_logit_sum if plan.negative_logit_sum else None,
        positive_lse=sums.positive_lse if plan.positives is not None else None,
        column_lse=sums.column_lse if plan.column_lse else None,
    )
