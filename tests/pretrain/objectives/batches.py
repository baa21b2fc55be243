"""A single-process batch from keywords, for tests that build :class:`ContrastiveBatch`
directly (``batch_loss`` builds the same one), and a probe of the tensors operators
allocate."""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from pretrain.objectives import BatchOptions, BatchRows, ContrastiveBatch, local_batch


def batch_of(z: Tensor, ids: Tensor, labels: Tensor | None = None,
             captions: Tensor | None = None, class_graph: Tensor | None = None,
             text: Tensor | None = None, **options: object) -> ContrastiveBatch:
    """``local_batch`` over these rows; ``options`` are :class:`BatchOptions` fields."""
    return local_batch(BatchRows(z, ids, labels, captions, text),
                       BatchOptions(class_graph=class_graph, **options))


class FreshAllocations(TorchDispatchMode):
    """Records the shapes of the floating-point tensors of at least ``numel`` elements (and
    last dimension ``width``, if given) that operators allocate: outputs whose storage none
    of the operator's inputs holds."""

    def __init__(self, numel: int, width: int | None = None) -> None:
        super().__init__()
        self.numel, self.width, self.shapes = numel, width, []

    @property
    def count(self) -> int:
        return len(self.shapes)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        held = {t.untyped_storage().data_ptr()
                for t in torch.utils._pytree.tree_leaves((args, kwargs))
                if isinstance(t, torch.Tensor)}
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if (isinstance(t, torch.Tensor) and t.is_floating_point()
                    and t.numel() >= self.numel
                    and self.width in (None, t.shape[-1])
                    and t.untyped_storage().data_ptr() not in held):
                self.shapes.append(tuple(t.shape))
        return out
