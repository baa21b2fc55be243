"""CLIP's text tower: a sentence-transformers model plus a linear projection.

The transformer (the bundled all-MiniLM-L6-v2 by default) is initialised from disk,
mean-pooled over the attention mask as sentence-transformers pools it, and projected to
the image projector's width. ``trainable=False`` freezes the transformer (only the
projection learns), the usual choice on CPU. Its tokenizer runs in the loader's workers
(``data_pipeline/text.py``), configured by the same section.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from data_pipeline.text import TextConfig, model_path


@dataclass
class TextTowerConfig(TextConfig):
    """``model.text.*``: used by ``clip`` only."""

    trainable: bool = False  # fine-tune the transformer (False: only the projection learns)


class TextTower(nn.Module):
    """token ids [B, L] and mask [B, L] -> text embeddings [B, out_dim] (un-normalised)."""

    def __init__(self, cfg: TextTowerConfig, out_dim: int) -> None:
        super().__init__()
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import AutoModel

        self.config = cfg  # its tokenizer (model, max_length) for callers that embed text
        self.transformer = AutoModel.from_pretrained(model_path(cfg.model))
        self.trainable = cfg.trainable
        self.transformer.requires_grad_(cfg.trainable)
        self.projection = nn.Linear(self.transformer.config.hidden_size, out_dim)

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """Every row runs through the transformer (a training step hands it each caption
        once: ``pretrain.loop.step.model_inputs``)."""
        with torch.set_grad_enabled(self.trainable and torch.is_grad_enabled()):
            hidden = self.transformer(input_ids=input_ids,
                                      attention_mask=attention_mask).last_hidden_state
            weights = attention_mask.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1)
        return self.projection(pooled)

    def train(self, mode: bool = True) -> TextTower:
        super().train(mode)
        if not self.trainable:  # a frozen transformer stays in eval mode (no dropout)
            self.transformer.eval()
        return self
