"""SINCERE (Feeney & Hughes, eq. 5); docs/objectives.md.

per anchor i: -1/|P(i)| sum_{p in P(i)} log( e^{s_ip/tau} / (e^{s_ip/tau - eps}
                                                      + sum_{n in Neg(i)} e^{s_in/tau}) )
Other positives never appear in the denominator. ``eps = 0`` is SINCERE; ``eps > 0`` is
epsilon-SupInfoNCE (``eps_supinfonce.py``). Each pair term is computed stably as
softplus(lse_neg - s_ip/tau + eps) - eps.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from pretrain.losses.batch import ContrastiveBatch
from pretrain.losses.columns import ColumnSet
from pretrain.losses.common import (
    ObjectiveOutput,
    Temperature,
    as_float,
    finish,
    full_precision,
    positive_logit_mean,
    require_labels,
    scaled,
    segment_logsumexp,
)
from pretrain.losses.rows import RowTerms, row_logsumexp
from pretrain.losses.tiles import PositiveTiles, tiled_pair_terms


def sincere_family(batch: ContrastiveBatch, temperature: Temperature,
                   eps: float) -> ObjectiveOutput:
    """Per-positive-pair NCE whose denominator holds only that positive and Neg(i)."""
    kind = "label"
    require_labels(batch, "sincere" if eps == 0 else "eps_supinfonce")
    with full_precision(batch):
        anchors = scaled(batch.anchors, temperature)  # [n, D]
        dense_pairs = None if batch.tile_size is not None else batch.positive_pairs(kind)
        negatives = row_logsumexp(batch, anchors, batch.candidates,
                                  ColumnSet(kind, positives=False), monitors=True,
                                  pairs=dense_pairs)
        pair_sum, all_lse = _pair_terms(batch, anchors, negatives, eps)  # [n], [n]
        pos_mean, num_pos = positive_logit_mean(batch, kind, temperature)
        loss = batch.anchor_mean(pair_sum / num_pos.clamp(min=1), kind)
        return finish(batch, loss, kind, temperature, pos_mean=pos_mean,
                      infonce=all_lse - pos_mean.detach(), ess=negatives.ess,
                      negative_logit_sum=negatives.negative_logit_sum)


def _pair_terms(batch: ContrastiveBatch, anchors: Tensor, negatives: RowTerms,
                eps: float) -> tuple[Tensor, Tensor]:
    """([n] sum over positives p of softplus(lse_neg - s_ip/tau + eps) - eps, with gradient;
    [n] logsumexp over negatives and positives, without). Dense: from the [P] positive
    pairs' logits read off the [n, N] logits; tiled: per column tile, so that no [P] (of
    order n N / C) tensor exists."""
    lse_neg = negatives.lse
    if batch.tile_size is not None:
        candidates = as_float(batch.candidates)
        labels = batch.labels
        positives = PositiveTiles(batch.tile_size, batch.anchor_index,
                                  labels[batch.anchor_index], labels)
        pair_sum, pos_lse = tiled_pair_terms(anchors, candidates, lse_neg, eps, positives)
        return pair_sum, torch.logaddexp(lse_neg.detach(), pos_lse)
    rows, _ = batch.positive_pairs("label")  # [P] positive pairs
    pos_logits = negatives.pair_logits  # [P]
    pair_loss = F.softplus(lse_neg[rows] - pos_logits + eps) - eps  # [P]
    pair_sum = torch.zeros_like(lse_neg).index_add(0, rows, pair_loss)
    return pair_sum, with_positives(lse_neg, pos_logits, rows)


def with_positives(lse_neg: Tensor, pos_logits: Tensor, rows: Tensor) -> Tensor:
    """[n] logsumexp over negatives and positives, from the negatives' [n] and the
    positive pairs' logits [P] (rows [P]); no gradient."""
    pos_lse = segment_logsumexp(pos_logits.detach(), rows, len(lse_neg))
    return torch.logaddexp(lse_neg.detach(), pos_lse)


def sincere(batch: ContrastiveBatch, temperature: Temperature) -> ObjectiveOutput:
    """SINCERE: supervised InfoNCE with same-class samples removed from each denominator."""
    return sincere_family(batch, temperature, eps=0.0)
