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

# one walk of the tiles for both directions, cross-modal monitors: beyond the vocabulary
from pretrain.losses.common import negative_cosine_sum, scalar, summarize_metrics
from pretrain.losses.rows import RowTerms, transposable
from pretrain.losses.vocabulary import (
    BatchRows,
    ColumnSet,
    ContrastiveBatch,
    ObjectiveOutput,
    Temperature,
    pair_logits,
    row_logsumexp,
    scaled,
)


def plain_clip(rows: BatchRows, tau: Temperature) -> Tensor:
    """CLIP's loss as written: image ``rows.z`` and ``rows.text`` [N, D] paired row by row,
    ``rows.ids`` [N] (rows of one image, its other views, are left out of each other's
    softmax)."""
    image, text, ids = F.normalize(rows.z, dim=1), F.normalize(rows.text, dim=1), rows.ids
    own = torch.eye(len(image), dtype=torch.bool, device=image.device)
    other_view = (ids[:, None] == ids[None, :]) & ~own
    logits = (image @ text.T / tau).masked_fill(other_view, float("-inf"))  # [N, N] i -> j
    target = torch.arange(len(image), device=image.device)
    return 0.5 * (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target))

# a row's own text (image) and the negatives; the other views of its image are left out
COLUMNS = ColumnSet("instance", positives=False, self_column=True)


def both_directions(batch: ContrastiveBatch, images: Tensor,
                    temperature: Temperature) -> tuple[RowTerms, Tensor]:
    """(image -> text rows with their monitors, [n] text -> image log-sum-exp) for
    ``images`` [n, D] over tau. When every row is an anchor (one rank holding the whole
    batch) the text -> image logits are the image -> text ones transposed, and a tiled
    pass reads both directions from one walk of the tiles; otherwise each direction has
    its own."""
    if transposable(batch):
        rows = row_logsumexp(batch, images, batch.text, COLUMNS, monitors=True,
                             column_lse=True)
        return rows, rows.column_lse
    texts = scaled(batch.text[batch.anchor_index], temperature)  # [n, D]
    return (row_logsumexp(batch, images, batch.text, COLUMNS, monitors=True),
            row_logsumexp(batch, texts, batch.candidates, COLUMNS).lse)


def clip(batch: ContrastiveBatch, temperature: Temperature) -> ObjectiveOutput:
    """Symmetric image-text InfoNCE over ``batch.candidates`` and ``batch.text``."""
    images = scaled(batch.anchors, temperature)  # [n, D]
    image_to_text, text_to_image_lse = both_directions(batch, images, temperature)
    pos_logit = pair_logits(images, batch.text, batch.self_pairs())  # [n]
    per_anchor = 0.5 * (image_to_text.lse + text_to_image_lse) - pos_logit
    loss = batch.anchor_mean(per_anchor, None)
    with torch.no_grad():
        tau = scalar(temperature)
        neg_cos = negative_cosine_sum(batch, "instance", tau,
                                      image_to_text.negative_logit_sum, of="text")
        metrics = summarize_metrics(
            batch, None, infonce=(image_to_text.lse - pos_logit).detach(),
            ess=image_to_text.ess, num_positives=torch.ones_like(pos_logit),
            pos_cos=pos_logit.detach() * tau, neg_cos_sum=neg_cos)
    metrics.update(loss=loss.detach(), temperature=torch.as_tensor(tau))
    return ObjectiveOutput(loss, metrics)
