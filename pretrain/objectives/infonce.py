"""InfoNCE / SimCLR NT-Xent (Chen et al. 2020, eq. 1); docs/objectives.md.

per anchor i: -log( exp(s_ip/tau) / sum_{j != i} exp(s_ij/tau) ), p = the other view.
With more than two views per image the positives are averaged (SupCon with id labels).
"""

from __future__ import annotations

import dataclasses

from torch import Tensor

from pretrain.contrast.vocabulary import BatchRows, ContrastiveBatch, ObjectiveOutput
from pretrain.objectives.supcon import plain_supcon, supcon


def plain_infonce(rows: BatchRows, tau: float | Tensor) -> Tensor:
    """NT-Xent as written: ``rows.z`` [N, D] every view's embedding, ``rows.ids`` [N] (the
    views of one image share an id): SupCon with the ids as labels, which for two views is
    -log softmax_{j != i}(s_ij / tau) at the other view."""
    return plain_supcon(dataclasses.replace(rows, labels=rows.ids), tau)


def infonce(batch: ContrastiveBatch, temperature: float | Tensor) -> ObjectiveOutput:
    """NT-Xent over instance positives; labels are ignored."""
    return supcon(batch, temperature, kind="instance")
