"""A single-process batch from keywords, for tests that build :class:`ContrastiveBatch`
directly (``batch_loss`` builds the same one)."""

from __future__ import annotations

from torch import Tensor

from pretrain.losses import BatchOptions, BatchRows, ContrastiveBatch, local_batch


def batch_of(z: Tensor, ids: Tensor, labels: Tensor | None = None,
             captions: Tensor | None = None, class_graph: Tensor | None = None,
             text: Tensor | None = None, **options: object) -> ContrastiveBatch:
    """``local_batch`` over these rows; ``options`` are :class:`BatchOptions` fields."""
    return local_batch(BatchRows(z, ids, labels, captions, text),
                       BatchOptions(class_graph=class_graph, **options))
