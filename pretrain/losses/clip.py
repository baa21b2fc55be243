"""CLIP (Radford et al. 2021), the X-CLR paper's image-text baseline; SPEC ``clip``.

loss_i = 1/2 [ CE_i(image_i -> all texts) + CE_i(text_i -> all images) ], logits
z_img . z_txt / tau. Row i's own text is its positive; other rows with the same instance id
(further views of one image, whose captions are identical) are left out of the softmax.
Pass a learnable temperature tensor (1 / exp(logit_scale)) to learn the logit scale.
"""

from __future__ import annotations

import torch

from pretrain.losses.batch import ContrastiveBatch
from pretrain.losses.common import (
    ObjectiveOutput,
    Temperature,
    finish,
    full_precision,
    masked_logsumexp,
    similarity_logits,
)


def clip(batch: ContrastiveBatch, temperature: Temperature) -> ObjectiveOutput:
    """Symmetric image-text InfoNCE over ``batch.candidates`` and ``batch.text``."""
    if batch.text is None:
        raise ValueError("clip: needs the second modality's embeddings (text=)")
    with full_precision(batch):
        index = batch.anchor_index
        rows = torch.arange(index.shape[0], device=index.device)
        # the match plus every other instance's (kept) negative
        columns = batch.self_mask | batch.negative_mask("instance")
        image_to_text = similarity_logits(batch.anchors, batch.text, temperature)
        text_to_image = similarity_logits(batch.text[index], batch.candidates, temperature)
        pos_logit = image_to_text[rows, index]  # == text_to_image[rows, index]
        per_anchor = 0.5 * (masked_logsumexp(image_to_text, columns) - pos_logit
                            + masked_logsumexp(text_to_image, columns)
                            - text_to_image[rows, index])
        loss = batch.anchor_mean(per_anchor, None)
        return finish(batch, loss, image_to_text, None, temperature, pos_mean=pos_logit,
                      columns=columns, negatives=columns & ~batch.self_mask)
