"""CLIP (Radford et al. 2021), the X-CLR paper's image-text baseline;
``docs/objectives.md``.

loss_i = 1/2 [ CE_i(image_i -> all texts) + CE_i(text_i -> all images) ], logits
l_ij = z_img_i . z_txt_j / tau [N, N] (text -> image reads them transposed). Row i's own
text is its positive; other rows with the same instance id (further views of one image,
whose captions are identical) are left out of the softmax.
Pass a learnable temperature tensor (1 / exp(logit_scale)) to learn the logit scale.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from pretrain.contrast.vocabulary import (
    BatchRows,
    ContrastiveBatch,
    ObjectiveOutput,
    finish,
    logsumexp_both_ways,
    positive_logit_mean,
)


def plain_clip(rows: BatchRows, tau: float | Tensor) -> Tensor:
    """CLIP's loss as written: image ``rows.z`` and ``rows.text`` [N, D] paired row by row,
    ``rows.ids`` [N] (rows of one image, its other views, are left out of each other's
    softmax)."""
    image, text, ids = F.normalize(rows.z, dim=1), F.normalize(rows.text, dim=1), rows.ids
    own = torch.eye(len(image), dtype=torch.bool, device=image.device)
    other_view = (ids[:, None] == ids[None, :]) & ~own
    logits = (image @ text.T / tau).masked_fill(other_view, float("-inf"))  # [N, N] i -> j
    target = torch.arange(len(image), device=image.device)
    return 0.5 * (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target))

def clip(batch: ContrastiveBatch, temperature: float | Tensor) -> ObjectiveOutput:
    """Symmetric image-text InfoNCE over ``batch.candidates`` and ``batch.text``."""
    # image -> text over the anchor's row, text -> image down its own text's column: [n]
    # each, over its own pair and the negatives (the other views of its image left out)
    rows, column_lse = logsumexp_both_ways(batch, batch.text, "instance",
                                           over="negatives_and_self", temperature=temperature)
    pos_logit, _ = positive_logit_mean(batch, "text", temperature)  # [n]
    per_anchor = 0.5 * (rows.lse + column_lse) - pos_logit
    loss = batch.anchor_mean(per_anchor, None)
    return finish(batch, loss, "text", temperature, pos_mean=pos_logit,
                  infonce=rows.lse - pos_logit, ess=rows.ess,
                  negative_logit_sum=rows.negative_logit_sum)
