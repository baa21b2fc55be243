"""How a step's global batch is cut across the ranks of the current world.

A run keeps the global batch it began with (``data.global_batch=kept``): ``G`` instances a
step, recorded in every checkpoint, on any number of ranks. Rank ``r`` of ``W`` takes
``G // W`` instances, one more for the first ``G % W`` ranks (the loader deals them:
``data_pipeline/loader/plan.py``), and encodes them in cached-gradient chunks
(``pretrain/loop/chunked.py``) of at most its configured ``2 * data.batch_size`` rows, so
per-rank memory does not grow when ranks are lost. ``data.global_batch=per_rank`` keeps the
per-rank batch instead: ``G = data.batch_size * W`` follows the world.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class BatchCut:
    """``global_batch`` instances a step over ``world`` ranks whose configured batch is
    ``per_rank`` instances (two views each); ``chunkable``: the model can be encoded in
    chunks (not with ``model.split_views``)."""

    global_batch: int
    world: int
    per_rank: int
    chunkable: bool = True

    def share(self, rank: int) -> int:
        """Instances rank ``rank`` takes."""
        return self.global_batch // self.world + (rank < self.global_batch % self.world)

    @property
    def rows_per_rank(self) -> int:
        """The most rows (two views an instance) a rank contributes."""
        return 2 * math.ceil(self.global_batch / self.world)

    def chunk_rows(self, configured: int) -> int:
        """Rows a rank encodes at a time: ``train.chunk_size`` when set; else, where a
        share exceeds the configured batch, chunks of the configured batch's rows; 0
        (the whole share at once) otherwise."""
        if configured or not self.chunkable:
            return configured
        return 2 * self.per_rank if self.rows_per_rank > 2 * self.per_rank else 0

    def describe(self, configured_chunk: int) -> str:
        shares = sorted({self.share(r) for r in range(self.world)})
        chunk = self.chunk_rows(configured_chunk)
        return (f"global batch {self.global_batch} on {self.world} rank(s): "
                f"{' or '.join(map(str, shares))} instances a rank"
                + (f", encoded in chunks of at most {chunk} rows" if chunk else
                   ", encoded at once"))


def recorded_global_batch(checkpoints: list[Path]) -> int:
    """The global batch the newest readable checkpoint of ``checkpoints`` records (0:
    none does). Only the small entries of ``shared.pt`` are read (memory-mapped)."""
    for path in checkpoints:
        try:
            shared = torch.load(path / "shared.pt", map_location="cpu", weights_only=True,
                                mmap=True)
        except Exception:  # noqa: BLE001 (unreadable: Checkpointer.load reports and skips it)
            continue
        return int(shared.get("global_batch", 0))
    return 0
