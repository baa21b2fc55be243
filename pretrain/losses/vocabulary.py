"""The vocabulary a loss is written in (``docs/architecture.md``, "Writing a loss").

A loss is ``fn(batch: ContrastiveBatch, temperature, **keys) -> ObjectiveOutput`` beside its
plain form ``plain(rows: BatchRows, tau, **keys) -> Tensor``. Between the two sit the
operations below: each one the same whether the batch is dense or walked in column tiles,
keeps every negative or a seeded subset, lives in one process or was gathered from many;
the loss never asks which. The table's generic call checks what the entry declares
(labels, text) and turns autocast off around the loss.
"""

from __future__ import annotations

from pretrain.losses.batch import BatchRows, ContrastiveBatch
from pretrain.losses.columns import ColumnSet
from pretrain.losses.common import ObjectiveOutput, Temperature, finish, positive_logit_mean
from pretrain.losses.rows import row_logsumexp

__all__ = [
    # what a loss receives and returns
    "BatchRows", "ContrastiveBatch", "ObjectiveOutput", "Temperature",
    # what it computes with
    "ColumnSet", "finish", "positive_logit_mean", "row_logsumexp",
]
