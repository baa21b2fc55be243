"""X-CLR's soft targets beside the row reduction: one call gives each anchor's
log-sum-exp over every other candidate and sum_j t_ij s_ij / tau, with the targets
t_ij = softmax_{j != i}(c_i . c_j / tau_s), dense, grouped or over column tiles.

Tiled (``batch.tile_size``): the log-sum-exp runs over column tiles (``tiles.py``). The
class graph's targets keep their [n, C] group form (C classes); caption targets, and any
under ``num_negatives``, are recomputed per tile in the same pass as the logits, from the
captions or from the graph rows of the anchors' labels [n, C].

Cost: with the class graph t_ij is constant over a label group, so sum_j t_ij s_ij =
sum_c w_ic z_i . S_c with S_c the class's sum of embeddings: O(n C D) instead of another
pass over [n, N]. Caption targets take one group per candidate ([n, N]): whether views
share a caption is not asked of the device (docs/training.md, "Host synchronisation").
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from pretrain.contrast.batch import NORM_EPS, ContrastiveBatch, PositiveKind
from pretrain.contrast.columns import MASKED_LOGIT, Columns, ColumnSet
from pretrain.contrast.common import (
    Temperature,
    add_log_columns_,
    as_float,
    row_dot,
    scaled,
)
from pretrain.contrast.rows import (
    ess_from_ratio,
    logsumexp,
    lse_and_softmax,
    softmax_ess,
    spend,
    tile_plan,
    tiled_batch_rows,
)
from pretrain.contrast.target_top_k import (
    TopKTargets,
    dense_floor,
    group_floor,
    keep_top_k_,
    tiled_floor,
)
from pretrain.contrast.tiles import TargetLogits

COLUMNS = ColumnSet("instance")  # every candidate but the anchor itself


class SoftTargetRows(NamedTuple):
    """Per-anchor results [n]: ``lse`` and ``target_term`` with gradient; the targets'
    entropy and the monitors without."""

    lse: Tensor  # logsumexp_{j != i} s_ij / tau
    target_term: Tensor  # sum_j t_ij s_ij / tau
    entropy: Tensor  # -sum_j t_ij log t_ij
    ess: Tensor
    negative_logit_sum: Tensor | None


def soft_target_rows(batch: ContrastiveBatch, temperature: Temperature,
                     target_temperature: float, top_k: int = 0,
                     tie: float = 0.0) -> SoftTargetRows:
    """The two terms of -sum_j t_ij log q_ij for each anchor, with the targets from the
    batch's captions or its class graph at ``target_temperature`` (tau_s), over each
    anchor's ``top_k`` most similar candidates (0: all), those within ``tie`` in cosine of
    the k-th kept with it (``target_top_k.py``)."""
    # tiles: class-graph targets stay per label group ([n, C]); captions go per tile
    grouped = batch.num_negatives is None and (
        batch.tile_size is None or batch.class_graph is not None)
    tie = tie / target_temperature  # in target logits
    if batch.tile_size is not None and not grouped:
        targets = target_logits(batch, target_temperature)
        if top_k:
            columns = batch.column_tiles(COLUMNS)
            floor = tiled_floor(targets, columns, len(batch.anchor_index),
                                batch.num_candidates, batch.tile_size, top_k,
                                as_float(batch.candidates))
            targets = TopKTargets(targets, floor, tie)
        plan = tile_plan(batch, COLUMNS, monitors=True, targets=targets,
                         # cosines: u_ij = u_ji, unless each row keeps its own top k
                         symmetric=batch.class_graph is None and not top_k)
        tiled = tiled_batch_rows(batch, batch.anchors, batch.candidates, plan, temperature)
        return SoftTargetRows(tiled.lse, tiled.target_term, tiled.target_entropy,
                              ess_from_ratio(batch, "instance", tiled.ess_ratio),
                              tiled.negative_logit_sum)
    anchors = scaled(batch.anchors, temperature)  # [n, D]
    if batch.class_graph is None and batch.num_negatives is None:
        return _caption_rows(batch, anchors, target_temperature, top_k, tie)
    kind, sim = target_groups(batch, target_temperature)
    rows = logsumexp(batch, anchors, batch.candidates, "instance", over="others")
    if batch.num_negatives is None:
        term, entropy = _grouped_target_term(batch, kind, sim, temperature, top_k, tie)
    else:
        term, entropy = _dense_target_term(batch, kind, sim, anchors, top_k, tie)
    return SoftTargetRows(rows.lse, term, entropy, rows.ess, rows.negative_logit_sum)


def target_groups(batch: ContrastiveBatch,
                  target_temperature: float) -> tuple[PositiveKind | None, Tensor]:
    """(group kind, [n, G] c_i . c_g / tau_s) for the groups within which targets are constant.

    Class graph: label groups, the graph's C classes ([n, C]). Captions: one group per
    candidate ([n, N]; kind None), whether or not the views of an image share a caption.
    Computed in the embeddings' precision, whatever the graph's or captions' dtype.
    """
    dtype = as_float(batch.candidates).dtype
    if batch.class_graph is not None:
        graph = batch.class_graph.to(dtype)
        batch.group_index("label")  # labels checked against the graph's classes
        return "label", graph.index_select(0, batch.labels[batch.anchor_index]) / \
            target_temperature
    captions = F.normalize(batch.captions.to(dtype), dim=1)
    return None, (captions[batch.anchor_index] / target_temperature) @ captions.T


def _caption_rows(batch: ContrastiveBatch, anchors: Tensor, target_temperature: float,
                  top_k: int, tie: float) -> SoftTargetRows:
    """Caption targets over every column but self, dense: t_ij = softmax_j(c_i . c_j /
    tau_s) and the logits ``anchors`` [n, D] (over tau) . c_j meet in one [n, N]
    softmax, which gives the log-sum-exp and sum_j t_ij l_ij; the backward forms their
    gradient with respect to the logits, softmax - t, in place (two matmuls fewer than a
    target term through t @ candidates)."""
    with torch.no_grad():
        _, sim = target_groups(batch, target_temperature)  # [n, N], held here alone
        counts = (torch.ones(batch.num_candidates, dtype=torch.long, device=sim.device)
                  if batch.valid is None else batch.valid.long())
        add_log_columns_(sim, batch.anchor_index, counts)  # self and padding: no mass
        if top_k:
            keep_top_k_(sim, dense_floor(sim, top_k), tie)
        log_targets = torch.log_softmax(sim, dim=1)
        targets = torch.exp(log_targets, out=sim)  # sim's buffer
        entropy = -log_targets.mul_(targets).sum(1)  # 0 at the masked entries (t = 0)
        del sim, log_targets  # one [n, N] kept
    logits = anchors @ as_float(batch.candidates).T  # [n, N]
    lse, term, probs = row_softmax_and_targets_(logits, batch.columns(COLUMNS), targets)
    ess = softmax_ess(batch, COLUMNS, probs, scratch=logits)
    return SoftTargetRows(lse, term, entropy, ess, None)


def _grouped_target_term(batch: ContrastiveBatch, kind: PositiveKind, sim: Tensor,
                         temperature: Temperature, top_k: int,
                         tie: float) -> tuple[Tensor, Tensor]:
    """([n] sum_j t_ij s_ij / tau, [n] target entropy) when every column but self is kept.

    ``sim`` [n, G] (overwritten) holds c_i . c_g / tau_s. With m_ig members of group g in
    anchor i's columns, P_ig = softmax_g(sim_ig + log m_ig) is the target mass of group g
    and each member gets t_ij = P_ig / m_ig. Under ``top_k`` the groups below the k-th
    column's logit get no mass.
    """
    _, groups, counts = batch.group_index(kind)
    anchor_group = groups[batch.anchor_index]
    rows = torch.arange(len(anchor_group), device=sim.device)
    with torch.no_grad():
        dropped = None
        if top_k:
            members = counts[None, :].expand_as(sim).clone()
            members[rows, anchor_group] -= 1  # the anchor is not its own column
            dropped = sim < (group_floor(sim, members, top_k) - tie)[:, None]
        add_log_columns_(sim, anchor_group, counts)
        if dropped is not None:
            sim.masked_fill_(dropped, MASKED_LOGIT)
        log_mass = torch.log_softmax(sim, dim=1)  # [n, G]
        weights = log_mass.exp()  # [n, G] P_ig, then the target of each member
        members = counts.clamp(min=1).to(sim.dtype)  # an empty group's mass is 0
        own = (members[anchor_group] - 1).clamp(min=1)  # the own group, less the anchor
        log_members = torch.log(members)
        own_mass = weights[rows, anchor_group]
        entropy = -row_dot(weights, log_mass) + weights @ log_members + own_mass * (
            torch.log(own) - log_members[anchor_group])  # over groups, then their members
        weights.div_(members)
        own_weight = own_mass / own
        weights[rows, anchor_group] = own_weight
    anchors = as_float(batch.anchors)
    term = (anchors * (weights @ batch.group_sums(kind))).sum(1)
    # the group's sum holds the anchor itself
    self_sim = (anchors * as_float(batch.candidates)[batch.anchor_index]).sum(1)
    return (term - own_weight * self_sim) / temperature, entropy


def _dense_target_term(batch: ContrastiveBatch, kind: PositiveKind | None, sim: Tensor,
                       anchors: Tensor, top_k: int, tie: float) -> tuple[Tensor, Tensor]:
    """The same for per-anchor column subsets (``num_negatives``): [n, N] targets, under
    ``top_k`` over the k most similar columns of the subset."""
    with torch.no_grad():
        if kind is not None:
            sim = sim[:, batch.group_index(kind)[1]]
        sim = batch.columns(COLUMNS).apply(sim, MASKED_LOGIT)
        if top_k:
            keep_top_k_(sim, dense_floor(sim, top_k), tie)
        log_targets = torch.log_softmax(sim, dim=1)
        targets = log_targets.exp()
        entropy = -row_dot(targets, log_targets)
    return torch.linalg.vecdot(anchors, targets @ as_float(batch.candidates)), entropy


def target_logits(batch: ContrastiveBatch, target_temperature: float) -> TargetLogits:
    """Per column tile [start, stop) and block of anchor rows: the [rows, T] target logits
    c_i . c_j / tau_s."""
    dtype = as_float(batch.candidates).dtype
    if batch.class_graph is not None:
        rows = batch.class_graph.to(dtype).index_select(0, batch.labels[batch.anchor_index])
        rows = rows.div_(target_temperature)  # [n, C]
        return lambda start, stop, block, out: torch.index_select(
            rows[block], 1, batch.labels[start:stop], out=out)
    return _CaptionTargets(batch.captions.to(dtype), batch.anchor_index, target_temperature)


class _CaptionTargets:
    """cos(c_i, c_j) / tau_s from the caption embeddings [N, E] as given: the anchors'
    captions gathered and normalised once per block of rows (tiles come block by block),
    each tile's columns scaled by their inverse norms [N]. No [n, E] or [N, E] copy: at
    E = 384 one outweighs the [N, D] embeddings three times."""

    def __init__(self, captions: Tensor, anchor_index: Tensor, temperature: float) -> None:
        self.captions, self.anchor_index, self.temperature = captions, anchor_index, temperature
        # F.normalize's clamp, so tiles equal the dense path's normalised captions
        self.inverse_norms = torch.linalg.vector_norm(captions, dim=1).clamp_(
            min=NORM_EPS).reciprocal_()
        self._block, self._anchors = slice(0), captions[:0]

    def __call__(self, start: int, stop: int, block: slice, out: Tensor) -> Tensor:
        if block != self._block:
            rows = self.anchor_index[block]
            scale = self.inverse_norms[rows, None] / self.temperature
            self._block, self._anchors = block, self.captions[rows].mul_(scale)
        return torch.mm(self._anchors, self.captions[start:stop].T, out=out).mul_(
            self.inverse_norms[start:stop])


def row_softmax_and_targets_(logits: Tensor, columns: Columns,
                             targets: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The row softmax (``rows.py``) beside soft ``targets`` [n, N] (no gradient, 0 wherever
    ``columns`` leaves an entry out): ([n] logsumexp, [n] sum_j t_ij l_ij, both with
    gradient; [n, N] the softmax, detached). ``logits`` is overwritten, and left as
    scratch."""
    with torch.no_grad():
        columns.fill_(logits, MASKED_LOGIT)
    return _RowSoftmaxAndTargets.apply(logits, targets)


class _RowSoftmaxAndTargets(torch.autograd.Function):
    """``rows.py``'s row softmax with soft targets t [n, N] (no gradient, 0 at the left-out
    entries): also each row's sum_j t_ij l_ij, made in ``masked``'s buffer. Backward: the
    gradient with respect to the logits, g_lse * softmax + g_term * t (for lse - term:
    softmax - t), formed in place in the saved softmax; the targets never enter a matmul."""

    @staticmethod
    def forward(ctx, masked: Tensor, targets: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        ctx.set_materialize_grads(False)
        ctx.spent = False
        lse, probs = lse_and_softmax(masked)
        # masked is spent: 0 * MASKED_LOGIT is 0 at the left-out entries
        term = masked.mul_(targets).sum(1)
        ctx.save_for_backward(probs, targets)
        ctx.mark_non_differentiable(probs)
        return lse, term, probs

    @staticmethod
    def backward(ctx, grad_lse: Tensor | None, grad_term: Tensor | None,
                 grad_probs: None) -> tuple[Tensor | None, None]:
        spend(ctx)
        probs, targets = ctx.saved_tensors
        if grad_lse is None and grad_term is None:
            return None, None
        grad = probs.mul_(grad_lse[:, None]) if grad_lse is not None else probs.zero_()
        if grad_term is not None:
            grad.addcmul_(targets, grad_term[:, None])
        return grad, None
