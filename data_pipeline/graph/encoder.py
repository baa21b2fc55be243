"""The sentence-transformers caption encoder (default: the bundled all-MiniLM-L6-v2)."""

from __future__ import annotations

import os
from functools import lru_cache

import numpy as np
import torch

from data_pipeline.text import model_path


def load_encoder(name: str, device: str = "auto"):
    """A SentenceTransformer loaded from disk only (no hub access), once per process."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return _load(name, device)


@lru_cache(maxsize=2)
def _load(name: str, device: str):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(model_path(name), device=device)


def encode(model, captions: list[str], batch_size: int) -> tuple[np.ndarray, int]:
    """([n, E] float16 L2-normalised embeddings, how many captions were truncated)."""
    lengths = model.tokenizer(captions, add_special_tokens=True, truncation=False,
                              return_length=True)["length"]
    truncated = int(sum(length > model.max_seq_length for length in lengths))
    vectors = model.encode(captions, batch_size=batch_size, convert_to_numpy=True,
                           normalize_embeddings=True, show_progress_bar=False)
    return vectors.astype(np.float16), truncated
