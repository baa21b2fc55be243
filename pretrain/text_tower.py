"""CLIP's text tower: the bundled sentence-transformers model plus a linear projection.

The transformer (all-MiniLM-L6-v2 by default) is initialised from disk, mean-pooled over
the attention mask as sentence-transformers pools it, and projected to the image
projector's width. ``trainable=False`` freezes the transformer (only the projection learns),
the usual choice on CPU. Captions are tokenised in the loader's workers
(:func:`load_tokenizer`), so the training process only moves token ids.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from data_pipeline.graph.encoder import model_path
from pretrain.config import InvalidValue


@dataclass
class TextConfig:
    """``model.text.*``: used by ``clip`` only."""

    model: str = "bundled"  # the bundled all-MiniLM-L6-v2, or a local model directory
    trainable: bool = False  # False: frozen transformer, trainable projection
    max_length: int = 32  # tokens per caption

    def validate(self) -> None:
        if self.max_length < 2:
            raise InvalidValue("max_length", f"must be >= 2, got {self.max_length}")


def load_tokenizer(name: str):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path(name))


def tokenize(tokenizer, captions: list[str], max_length: int) -> dict[str, Tensor]:
    """captions -> {"input_ids", "attention_mask"}: [B, max_length] int64 each."""
    tokens = tokenizer(captions, padding="max_length", truncation=True,
                       max_length=max_length, return_tensors="pt")
    return {"input_ids": tokens["input_ids"], "attention_mask": tokens["attention_mask"]}


class TextTower(nn.Module):
    """token ids [B, L] and mask [B, L] -> text embeddings [B, out_dim] (un-normalised)."""

    def __init__(self, cfg: TextConfig, out_dim: int) -> None:
        super().__init__()
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import AutoModel

        self.transformer = AutoModel.from_pretrained(model_path(cfg.model))
        self.trainable = cfg.trainable
        self.transformer.requires_grad_(cfg.trainable)
        self.projection = nn.Linear(self.transformer.config.hidden_size, out_dim)

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        with torch.set_grad_enabled(self.trainable and torch.is_grad_enabled()):
            hidden = self.transformer(input_ids=input_ids,
                                      attention_mask=attention_mask).last_hidden_state
            mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1)
        return self.projection(pooled)

    def train(self, mode: bool = True) -> TextTower:
        super().train(mode)
        if not self.trainable:  # a frozen transformer stays in eval mode (no dropout)
            self.transformer.eval()
        return self
