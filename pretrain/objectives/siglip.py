"""SigLIP (Zhai et al. 2023, "Sigmoid Loss for Language Image Pre-Training", eq. 1 and
Algorithm 1); ``docs/objectives.md``.

loss = -1/N sum_i sum_j log sigmoid(z_ij (x_i . y_j / tau + b)), z_ij = 1 for row i's own
text and -1 for every other text: each image-text pair is its own binary decision, with no
softmax over the batch. tau (the paper's 1/t) is learnable through a 0-dim temperature
tensor, and b is a bias the model owns and hands in (``objective.siglip.bias`` initialises
it; the paper starts at t = 10, b = -10). Other rows with the same instance id (further views
of one image, whose captions are identical) are neither positive nor negative, as in
``clip``. Under ``num_negatives`` each anchor's negative terms run over its seeded subset.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn import functional as F

from pretrain.contrast.vocabulary import (
    BatchRows,
    ContrastiveBatch,
    ObjectiveOutput,
    finish,
    positive_logit_mean,
    sigmoid_rows,
)


def plain_siglip(rows: BatchRows, tau: float | Tensor, bias: float | Tensor) -> Tensor:
    """SigLIP's loss as written: image ``rows.z`` and ``rows.text`` [N, D] paired row by row,
    ``rows.ids`` [N] (an image's other views are neither positive nor negative)."""
    image, text, ids = F.normalize(rows.z, dim=1), F.normalize(rows.text, dim=1), rows.ids
    own = torch.eye(len(image), dtype=torch.bool, device=image.device)
    other_view = (ids[:, None] == ids[None, :]) & ~own
    sign = own.to(image.dtype) * 2 - 1                                     # z_ij: 1 or -1
    pair_loss = -F.logsigmoid(sign * (image @ text.T / tau + bias))        # [N, N]
    return pair_loss.masked_fill(other_view, 0.0).sum() / len(image)

@dataclass
class SigLIPConfig:
    """``objective.siglip.*``."""

    bias: float = -10.0  # initial value of the learned logit bias b (Zhai et al.)


def siglip(batch: ContrastiveBatch, temperature: float | Tensor, *,
           bias: float | Tensor) -> ObjectiveOutput:
    """Pairwise sigmoid loss of ``batch.anchors`` against every text in ``batch.text``."""
    negatives = sigmoid_rows(batch, batch.text, temperature, bias)
    pos_logit, _ = positive_logit_mean(batch, "text", temperature)  # [n], without b
    loss = batch.anchor_mean(F.softplus(-(pos_logit + bias)), None) + negatives.weighted_sum
    return finish(batch, loss, "text", temperature, pos_mean=pos_logit,
                  negative_logit_sum=negatives.product_sum, extra={"bias": bias})
