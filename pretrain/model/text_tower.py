"""CLIP's text tower: a sentence-transformers model plus a linear projection.

The transformer (the bundled all-MiniLM-L6-v2 by default) is initialised from disk,
mean-pooled over the attention mask as sentence-transformers pools it, and projected to
the image projector's width (with a bias unless ``projection_bias=false``).
``trainable=False`` freezes the transformer (only the projection learns), the usual choice
on CPU. ``scratch_layers`` > 0 instead builds a BERT of that depth and ``scratch_width``
from random weights over the same tokenizer's vocabulary and trains it with the image side,
as the X-CLR paper's CC3M CLIP trained its own. Its tokenizer runs in the loader's workers
(``data_pipeline/text.py``), configured by the same section.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from core.config import InvalidValue
from core.errors import RunError
from data_pipeline.text import TextConfig, model_path
from pretrain.model.activation_checkpointing import checkpoint_children


@dataclass
class TextTowerConfig(TextConfig):
    """``model.text.*``: used by ``clip`` only."""

    trainable: bool = False  # fine-tune the transformer (False: only the projection learns)
    projection_bias: bool = True  # false: a projection without bias, as open_clip's
    scratch_layers: int = 0  # > 0: a BERT of this many layers from random weights (trainable)
    scratch_width: int = 128  # its width (heads of 32, feed-forward 4x)

    def validate(self) -> None:
        super().validate()
        if self.scratch_layers < 0:
            raise InvalidValue("scratch_layers", f"must be >= 0, got {self.scratch_layers}")
        if self.scratch_layers and not self.trainable:
            raise InvalidValue("trainable", "a text tower from scratch (scratch_layers > 0) "
                               "must be trainable: set model.text.trainable=true")
        if self.scratch_width < 32 or self.scratch_width % 32:
            raise InvalidValue("scratch_width",
                               f"must be a multiple of 32 (heads of 32), got {self.scratch_width}")


class TextTower(nn.Module):
    """token ids [B, L] and mask [B, L] -> text embeddings [B, out_dim] (un-normalised)."""

    def __init__(self, cfg: TextTowerConfig, out_dim: int) -> None:
        super().__init__()
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import AutoModel

        self.config = cfg  # its tokenizer (model, max_length) for callers that embed text
        self.transformer = (scratch_transformer(cfg) if cfg.scratch_layers else
                            AutoModel.from_pretrained(model_path(cfg.model)))
        self.trainable = cfg.trainable
        self.transformer.requires_grad_(cfg.trainable)
        # a BERT's pooler (its [CLS] head) gets no gradient under mean pooling, which DDP
        # refuses at the second step; frozen, it stays in the state as the model has it
        pooler = getattr(self.transformer, "pooler", None)
        if isinstance(pooler, nn.Module):
            pooler.requires_grad_(False)
        self.projection = nn.Linear(self.transformer.config.hidden_size, out_dim,
                                    bias=cfg.projection_bias)

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """Every row runs through the transformer (a training step hands it each caption
        once: ``pretrain.loop.step.model_inputs``)."""
        with torch.set_grad_enabled(self.trainable and torch.is_grad_enabled()):
            hidden = self.transformer(input_ids=input_ids,
                                      attention_mask=additive_mask(attention_mask,
                                                                   self.dtype)
                                      ).last_hidden_state
            weights = attention_mask.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1)
        return self.projection(pooled)

    def checkpoint(self, every: int) -> None:
        """Activation checkpointing of the transformer's layers 0, k, 2k, ... (k =
        ``every``; ``pretrain/model/activation_checkpointing.py``); only a trainable tower
        holds them."""
        layers = self._layer_list()
        if layers is None:
            raise RunError(f"model.activation_checkpointing: {self.config.model} has no "
                           "encoder.layer list to checkpoint; set it to none")
        checkpoint_children(layers, every)

    def layers(self) -> list[nn.Module]:
        """The transformer's layers in order (none if it has no ``encoder.layer`` list)."""
        layers = self._layer_list()
        return [] if layers is None else list(layers)

    def _layer_list(self) -> nn.ModuleList | None:
        layers = getattr(getattr(self.transformer, "encoder", None), "layer", None)
        return layers if isinstance(layers, nn.ModuleList) else None

    @property
    def dtype(self) -> torch.dtype:
        return self.projection.weight.dtype

    def train(self, mode: bool = True) -> TextTower:
        super().train(mode)
        if not self.trainable:  # a frozen transformer stays in eval mode (no dropout)
            self.transformer.eval()
        return self


def scratch_transformer(cfg: TextTowerConfig) -> nn.Module:
    """A BERT of ``cfg.scratch_layers`` layers and width ``cfg.scratch_width`` from random
    weights (the caller's torch seed), over the vocabulary of ``cfg.model``'s tokenizer and
    ``cfg.max_length`` positions, without dropout (as open_clip's text towers)."""
    from transformers import AutoConfig, BertConfig, BertModel

    vocabulary = AutoConfig.from_pretrained(model_path(cfg.model)).vocab_size
    width = cfg.scratch_width
    return BertModel(BertConfig(vocab_size=vocabulary, hidden_size=width,
                                num_hidden_layers=cfg.scratch_layers,
                                num_attention_heads=width // 32, intermediate_size=4 * width,
                                max_position_embeddings=max(cfg.max_length, 2),
                                hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def additive_mask(attention_mask: Tensor, dtype: torch.dtype) -> Tensor:
    """The [B, L] padding mask as the [B, 1, 1, L] additive mask attention adds to its
    scores in ``dtype`` (0 where a token is seen, the dtype's minimum where it is padding),
    which transformers takes as it is. Handed the [B, L] mask, transformers first asks whether
    any token is padding (``padding_mask.all()``), a value read that makes the host wait
    for a GPU on every step; with fake tensors it skips that question, so only a real
    GPU shows it (``bench/gpu``, part ``sync``)."""
    seen = attention_mask[:, None, None, :].to(dtype)
    return (1.0 - seen) * torch.finfo(dtype).min


def random_text_model(directory: Path) -> str:
    """A randomly initialised 1-layer BERT (vocabulary of 128 ids, width 32) saved as a
    local model directory for ``model.text.model``: the tower's code path and shapes
    without the bundled weights (83 MB), for tests and for the GPU kit's dry runs on
    nodes that lack them. Made once per directory; returns its path."""
    from transformers import BertConfig, BertModel

    if not (directory / "config.json").is_file():
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            BertModel(BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, intermediate_size=64)
                      ).save_pretrained(directory)
    return str(directory)

