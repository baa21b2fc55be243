"""Class projections g(c) for ProjNCE (Jeong & Hero, Sec. 3) and the row terms they give.

Each projection is [G, D] for the G label groups of ``ContrastiveBatch.group_index``
(sorted distinct labels), computed from the *global* batch so that every rank agrees;
:func:`projected_rows` turns the chosen one into ProjNCE's per-anchor terms.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from pretrain.contrast.batch import ContrastiveBatch
from pretrain.contrast.common import Temperature, add_log_columns_, as_float, pair_logits, scaled
from pretrain.contrast.rows import RowTerms, logsumexp

# The most [rows, neighbours, D] elements one tile of the kernel weights gathers
GATHER_BUDGET = 2**24


class KernelMeans(NamedTuple):
    """The class means [G, D] and the fraction of real rows whose neighbours may not hold
    every sample within the bandwidth ([], 0 when the means are exact)."""

    means: Tensor
    truncated: Tensor


def kernel_class_means(candidates: Tensor, groups: Tensor, num_groups: int,
                       bandwidth: float, metric: str, neighbours: int,
                       tile_size: int | None = None,
                       valid: Tensor | None = None) -> KernelMeans:
    """Nadaraya-Watson class means f_hat(c) (eq. 16-17) with K(t) = 1 - t^2 on [0, 1],
    each sample weighing its ``neighbours`` = k most similar others.

    ``candidates`` [N, D] unit vectors, ``groups`` [N] group of each. Weights
    w_jm = K(d(z_j, z_m) / h) for the k columns m of largest z_j . z_m (0 for the rest);
    NW(c | z_j) = sum_m w_jm 1{g_m = c} / sum_m w_jm, the sample itself counted with
    K(0) = 1; f_hat(c) = sum_j NW(c | z_j) z_j / sum_j NW(c | z_j) (0 for an empty group).

    Exact when no row has more than k others within the bandwidth: for unit vectors the
    cosine ranks l2 and cos distances exactly, and l1 >= l2 puts an l1 ball inside the l2
    ball of the same radius. ``truncated`` flags the rows whose (k+1)-th most similar
    column still lies inside that ball (for l1 an upper bound). The neighbours come from a
    matrix product and a fixed-size top-k over [R, C] tiles (R rows; C columns, all N
    without ``tile_size`` T, else R C <= N T); the distances and weights are [R, k], their [R, k, D]
    pairs gathered again in the backward: no shape depends on the values, and the l1
    distance costs O(N k D) rather than O(N^2 D). ``valid`` [N] leaves padding out (it
    votes for no class and is nobody's neighbour).
    """
    n, dim = candidates.shape
    k = max(1, min(neighbours, n - 1))
    real = (torch.ones(n, dtype=torch.bool, device=candidates.device) if valid is None
            else valid)
    rows_per_tile = max(1, min(tile_size or n, GATHER_BUDGET // (k * dim)))
    # [R, C] products: at most the [N, T] of the other objectives' tiles
    columns_per_tile = n if tile_size is None else min(n, tile_size * n // rows_per_tile)
    ball = (1 - 2 * bandwidth) if metric == "cos" else (1 - bandwidth**2 / 2)  # cosine
    votes, row_sums, flagged = [], [], []
    for row in range(0, n, rows_per_tile):
        rows = candidates[row:row + rows_per_tile]
        nearest, chosen, outside = _nearest(rows.detach(), candidates.detach(), row, k,
                                            real, columns_per_tile)
        own = real[row:row + rows_per_tile]
        total, voted = _neighbour_votes(rows, candidates, nearest, own[:, None] & chosen,
                                        groups, num_groups, bandwidth, metric)
        itself = F.one_hot(groups[row:row + rows_per_tile], num_groups) * own[:, None]
        votes.append(voted + itself.to(voted.dtype))  # K(0) = 1: the sample itself
        row_sums.append(total + 1)
        flagged.append((outside > ball) & own)
    posterior = torch.cat(votes) / torch.cat(row_sums)[:, None]  # [N, G] NW(c | z_j)
    mass = posterior.sum(0)[:, None]
    means = (posterior.T @ candidates) / mass.clamp(min=torch.finfo(mass.dtype).tiny)
    truncated = torch.cat(flagged).sum() / real.sum().clamp(min=1)
    return KernelMeans(means, truncated.to(candidates.dtype))


@torch.no_grad()
def _nearest(rows: Tensor, candidates: Tensor, start: int, k: int, real: Tensor,
             step: int) -> tuple[Tensor, Tensor, Tensor]:
    """([R, k] the columns of largest rows . column; [R, k] False where that is the row
    itself or padding, which fill the places real columns leave; [R] the (k+1)-th largest
    product, -inf if there is none): the top k + 1 of each tile of ``step`` columns merged
    with the best so far."""
    r = torch.arange(rows.shape[0], device=rows.device)[:, None] + start
    best = best_index = None
    for col in range(0, candidates.shape[0], step):
        cols = torch.arange(col, min(col + step, candidates.shape[0]), device=rows.device)
        products = (rows @ candidates[col:col + step].T).masked_fill_(
            (cols[None, :] == r) | ~real[col:col + step][None, :], float("-inf"))
        values, at = products.topk(min(k + 1, len(cols)), dim=1)
        if best is not None:
            values, at = torch.cat([best, values], 1), torch.cat([best_index, at + col], 1)
            values, pick = values.topk(min(k + 1, values.shape[1]), dim=1)
            at = at.gather(1, pick)
        best, best_index = values, at
    return best_index[:, :k], best[:, :k] > float("-inf"), best[:, k]


def _neighbour_votes(rows: Tensor, candidates: Tensor, nearest: Tensor, keep: Tensor,
                     groups: Tensor, num_groups: int, bandwidth: float,
                     metric: str) -> tuple[Tensor, Tensor]:
    """([R] the kernel weights of each row over its ``nearest`` [R, k] columns, summed;
    [R, G] those weights summed per group); ``keep`` [R, k] is False where the row is
    padding or the column is the row itself or padding."""
    if metric == "cos":
        distance = 0.5 - 0.5 * NeighbourReduction.apply(rows, candidates, nearest, "dot")
        square = (distance / bandwidth) ** 2
    else:  # l2 squared directly: the root's gradient at 0 is infinite
        reduced = NeighbourReduction.apply(rows, candidates, nearest, metric)
        square = reduced / bandwidth**2 if metric == "l2" else (reduced / bandwidth) ** 2
    weight = (1 - square).clamp(min=0) * keep  # [R, k]
    voted = weight.new_zeros(weight.shape[0], num_groups).scatter_add(1, groups[nearest],
                                                                      weight)
    return weight.sum(1), voted


class NeighbourReduction(torch.autograd.Function):
    """[R, k] sum over d of f(rows[r, d], candidates[nearest[r, i], d]), f one of ``l1``
    |x - y|, ``l2`` (x - y)^2 and ``dot`` x y. The [R, k, D] pairs are gathered again in
    the backward rather than saved, so a tile holds [R, k] between the passes."""

    @staticmethod
    def forward(ctx, rows: Tensor, candidates: Tensor, nearest: Tensor, kind: str) -> Tensor:
        ctx.save_for_backward(rows, candidates, nearest)
        ctx.kind = kind
        pairs = _gathered(candidates, nearest)  # [R, k, D]
        if kind == "dot":
            return (pairs @ rows[:, :, None])[..., 0]
        difference = torch.sub(rows[:, None, :], pairs, out=pairs)
        return (difference.abs_() if kind == "l1" else difference.square_()).sum(2)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor, None, None]:
        rows, candidates, nearest = ctx.saved_tensors
        pairs = _gathered(candidates, nearest)
        if ctx.kind == "dot":  # d/dx = y, d/dy = x
            grad_rows = (grad[:, None, :] @ pairs)[:, 0]
            towards = grad[:, :, None] * rows[:, None, :]
        else:  # d/dx = -d/dy = sign(x - y) or 2 (x - y)
            towards = torch.sub(rows[:, None, :], pairs, out=pairs)
            towards = towards.sign_() if ctx.kind == "l1" else towards.mul_(2)
            towards.mul_(grad[:, :, None])
            grad_rows = towards.sum(1)
            towards.neg_()
        grad_candidates = torch.zeros_like(candidates).index_add_(
            0, nearest.flatten(), towards.view(-1, candidates.shape[1]))
        return grad_rows, grad_candidates, None, None


def _gathered(candidates: Tensor, nearest: Tensor) -> Tensor:
    return candidates.index_select(0, nearest.flatten()).view(*nearest.shape, -1)


def median_class_embeddings(candidates: Tensor, groups: Tensor, counts: Tensor,
                            valid: Tensor | None = None) -> Tensor:
    """Coordinate-wise lower median of each group's embeddings (ProjNCE-med, eq. 33).

    For an even count the lower of the two middle values is taken (``torch.median``'s
    convention); the gradient flows to the selected element of each coordinate. Sorted by
    value, then stably by group, each coordinate's rows are grouped in value order; each
    group's median is read at its start + (size - 1) // 2: fixed shapes throughout. A
    group without members gets an arbitrary finite row; padding rows (``valid`` [N]
    False) are sorted after every group.
    """
    if valid is not None:
        groups = torch.where(valid, groups, counts.shape[0])
    by_value = candidates.argsort(dim=0, stable=True)  # [N, D]
    by_group = groups[by_value].argsort(dim=0, stable=True)  # group-major, value order kept
    rows = by_value.gather(0, by_group)  # [N, D] rows sorted by (group, value)
    starts = torch.cumsum(counts, 0) - counts  # [G]
    middle = (starts + (counts - 1).clamp(min=0) // 2).clamp(max=candidates.shape[0] - 1)
    return candidates.gather(0, rows[middle])  # [G, D]


def learned_class_embeddings(class_embeddings: Tensor, group_labels: Tensor) -> Tensor:
    """Rows of a trainable [C, D] class-embedding matrix (ProjNCE-MLP, eq. 34), L2-normalised.

    Normalising keeps psi(z, g) = z . g / tau a cosine, like every other critic here; an
    unnormalised matrix could lower the loss by growing without bound. ``group_labels``
    [G] lie in [0, C) (the batch's label groups are the C classes; checked there).
    """
    return F.normalize(class_embeddings[group_labels], dim=1)


class ProjectedRows(NamedTuple):
    """Per-anchor terms [n] of ProjNCE, psi(z, v) = z . v / tau over the anchor's columns
    j != i, and the plain similarity logits' row terms for the monitors."""

    plus_own: Tensor  # psi(z_i, g+(y_i))
    lse_minus: Tensor  # log sum_j exp psi(z_i, g-(y_j))
    lse_plus: Tensor  # log sum_j exp psi(z_i, g+(y_j))
    similarity: RowTerms
    metrics: dict[str, Tensor]  # the projection's own (kernel_truncated)


def projected_rows(batch: ContrastiveBatch, temperature: Temperature, *, projection: str,
                   bandwidth: float, kernel_metric: str, neighbours: int,
                   class_embeddings: Tensor | None = None) -> ProjectedRows:
    """ProjNCE's row terms for the anchors over tau under ``objective.projnce.*``: the
    centroid with g- = z (its minus logits are the similarity logits); the others
    (``kernel``, ``median``, ``learned`` from the [C, D] ``class_embeddings``) with one
    projected vector per label group, g+ = g-."""
    anchors = scaled(batch.anchors, temperature)  # [n, D]
    if projection == "centroid":
        plus = _centroid_plus(batch)  # [N, D]
        minus = logsumexp(batch, anchors, batch.candidates, "label", over="others")
        plus_lse = logsumexp(batch, anchors, plus, "label", over="others", monitors=False).lse
        return ProjectedRows(pair_logits(anchors, plus, batch.self_pairs()), minus.lse,
                             plus_lse, minus, {})
    projected, metrics = _group_projection(batch, projection, bandwidth, kernel_metric,
                                           neighbours, class_embeddings)  # [G, D]
    _, groups, _ = batch.group_index("label")
    plus_own = pair_logits(anchors, projected, (batch.self_pairs()[0],
                                                groups[batch.anchor_index]))
    if batch.num_negatives is None and (batch.tile_size is None or batch.classes is not None):
        # [n, G] logits suffice (tiled: G the C classes, not N slots)
        lse = _group_lse(batch, anchors @ projected.T)
    else:
        lse = logsumexp(batch, anchors, projected[groups], "label", over="others",
                        monitors=False).lse
    with torch.no_grad():  # the monitors read the plain similarity logits
        similarity = logsumexp(batch, anchors.detach(), batch.candidates.detach(), "label",
                               over="others")
    return ProjectedRows(plus_own, lse, lse, similarity, metrics)


def _centroid_plus(batch: ContrastiveBatch) -> Tensor:
    """[N, D] g+(y_k) = (S_{y_k} - z_k) / (n_{y_k} - 1) per candidate k; z_k if alone."""
    _, groups, counts = batch.group_index("label")
    cand = as_float(batch.candidates)
    alone = (counts[groups] == 1)[:, None]
    others = batch.group_sums("label")[groups] - cand
    others = others / (counts[groups] - 1).clamp(min=1)[:, None]
    return torch.where(alone, cand, others)


def _group_lse(batch: ContrastiveBatch, group_logits: Tensor) -> Tensor:
    """[n] log sum_{j != i} exp psi(z_i, g(y_j)) from [n, G] logits and group sizes."""
    _, groups, counts = batch.group_index("label")
    summed = add_log_columns_(group_logits.clone(), groups[batch.anchor_index], counts)
    return torch.logsumexp(summed, dim=1)


def _group_projection(batch: ContrastiveBatch, projection: str, bandwidth: float,
                      kernel_metric: str, neighbours: int,
                      class_embeddings: Tensor | None) -> tuple[Tensor, dict[str, Tensor]]:
    """[G, D] one projected vector per label group of the global batch, and the
    projection's own metrics."""
    values, groups, counts = batch.group_index("label")
    cand = as_float(batch.candidates)
    if projection == "kernel":  # its class posterior is [N, G]: give num_classes for G = C
        kernel = kernel_class_means(cand, groups, counts.shape[0], bandwidth, kernel_metric,
                                    neighbours, tile_size=batch.tile_size, valid=batch.valid)
        return kernel.means, {"kernel_truncated": kernel.truncated}
    if projection == "median":
        return median_class_embeddings(cand, groups, counts, batch.valid), {}
    return learned_class_embeddings(class_embeddings.to(cand.dtype), values), {}
