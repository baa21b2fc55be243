"""The vocabulary a loss is written in (``docs/architecture.md``, "Writing a loss").

A loss is ``fn(batch: ContrastiveBatch, temperature, **keys) -> ObjectiveOutput`` beside its
plain form ``plain(rows: BatchRows, tau, **keys) -> Tensor``; a temperature is a float or a
0-dim tensor (learnable). Between the two sit the operations below: each one the same
whether the batch is dense or walked in column tiles, keeps every negative or a seeded
subset, lives in one process or was gathered from many; the loss never asks which. The
table's ``declared`` checks what the entry declares (labels, text) and turns autocast off
around the loss, for ``batch_loss`` and the trainer alike.

Six core names serve more than one loss: what a loss receives and returns, ``finish``,
``positive_logit_mean`` and ``logsumexp``, the row softmax SupCon, InfoNCE and a new
softmax objective are written with. Six operations beside them each serve one objective:
three add to the row softmax what CLIP (its second direction), FlatNCE (the positives'
log-sum-exp) and SINCERE (its pair terms) need; three are the reductions of objectives
whose terms are not a softmax over a row: X-CLR's soft targets, SigLIP's sigmoid pairs and
ProjNCE's class projections.
"""

from __future__ import annotations

from pretrain.contrast.batch import BatchRows, ContrastiveBatch
from pretrain.contrast.common import ObjectiveOutput, finish, positive_logit_mean
from pretrain.contrast.pair_terms import pair_terms
from pretrain.contrast.projections import projected_rows
from pretrain.contrast.rows import logsumexp, logsumexp_both_ways, logsumexp_with_positives
from pretrain.contrast.sigmoid_rows import sigmoid_rows
from pretrain.contrast.soft_targets import soft_target_rows

__all__ = [
    # what a loss receives and returns
    "BatchRows", "ContrastiveBatch", "ObjectiveOutput",
    # what it computes with
    "finish", "positive_logit_mean", "logsumexp",
    # the operations of one objective each: clip, flatnce, sincere, xclr, siglip, projnce
    "logsumexp_both_ways", "logsumexp_with_positives", "pair_terms",
    "soft_target_rows", "sigmoid_rows", "projected_rows",
]
ONE_OBJECTIVE = ("logsumexp_both_ways", "logsumexp_with_positives", "pair_terms",
                 "soft_target_rows", "sigmoid_rows", "projected_rows")
CORE = tuple(name for name in __all__ if name not in ONE_OBJECTIVE)
