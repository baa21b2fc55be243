"""CLIP (Radford et al. 2021), the X-CLR paper's image-text baseline;
``docs/objectives.md``.

loss_i = 1/2 [ CE_i(image_i -> all texts) + CE_i(text_i -> all images) ], logits
z_img . z_txt / tau. Row i's own text is its positive; other rows with the same instance id
(further views of one image, whose captions are identical) are left out of the softmax.
Pass a learnable temperature tensor (1 / exp(logit_scale)) to learn the logit scale.
"""

from __future__ import annotations

import torch

from pretrain.losses.batch import Columns, ContrastiveBatch
from pretrain.losses.common import (
    ObjectiveOutput,
    Temperature,
    full_precision,
    negative_cosine_sum,
    row_softmax_,
    scalar,
    similarity_logits,
    summarize_metrics,
)


def clip(batch: ContrastiveBatch, temperature: Temperature) -> ObjectiveOutput:
    """Symmetric image-text InfoNCE over ``batch.candidates`` and ``batch.text``."""
    if batch.text is None:
        raise ValueError("clip: needs the second modality's embeddings (text=)")
    with full_precision(batch):
        index = batch.anchor_index
        rows = torch.arange(index.shape[0], device=index.device)
        if batch.num_negatives is None:  # all but the other views of the same instance
            columns = Columns(drop=batch.positive_pairs("instance"))
        else:
            columns = Columns(keep=batch.self_mask | batch.negative_mask("instance"))
        image_to_text = similarity_logits(batch.anchors, batch.text, temperature)  # [n, N]
        text_to_image = similarity_logits(batch.text[index], batch.candidates, temperature)
        pos_logit = image_to_text[rows, index]  # equals text_to_image[rows, index]
        pos_logit_t2i = text_to_image[rows, index]
        lse_i2t, probs = row_softmax_(image_to_text, columns)
        lse_t2i, _ = row_softmax_(text_to_image, columns)
        per_anchor = 0.5 * (lse_i2t - pos_logit + lse_t2i - pos_logit_t2i)
        loss = batch.anchor_mean(per_anchor, None)
        with torch.no_grad():
            tau = scalar(temperature)
            neg_cos = negative_cosine_sum(batch, image_to_text, "instance", tau, of="text")
            metrics = summarize_metrics(
                batch, None, infonce=(lse_i2t - pos_logit).detach(), probs=probs,
                positives=(rows, index), num_positives=torch.ones_like(index),
                pos_cos=pos_logit.detach() * tau, neg_cos_sum=neg_cos)
        metrics.update(loss=loss.detach(), temperature=torch.as_tensor(tau))
        return ObjectiveOutput(loss, metrics)
