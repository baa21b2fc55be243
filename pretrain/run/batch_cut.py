"""How a step's global batch is cut across the ranks of the current world.

A run keeps the global batch it began with (``data.global_batch=kept``): ``G`` instances a
step, recorded in every checkpoint, on any number of ranks. The global batch is ``C =
ceil(G / B)`` chunks of ``B = data.batch_size`` instances (the last takes the rest), the
same chunks on any world (``data_pipeline/loader/plan.py``); rank ``r`` of ``W`` takes
``C // W`` of them whole, one more for the first ``C % W`` ranks, so a world cannot exceed
``C`` ranks. A rank encodes its chunks one at a time with the cached gradient
(``pretrain/loop/chunked.py``) when some rank holds more than one, so per-rank memory does
not grow when ranks are lost, and batch norm sees the same chunks on any world.
``data.global_batch=per_rank`` keeps the per-rank batch instead: ``G = B * W`` follows the
world.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from data_pipeline.loader.plan import Layout


@dataclass(frozen=True)
class BatchCut:
    """``global_batch`` instances a step over ``world`` ranks, in chunks of ``per_chunk``
    instances (the configured batch; two views each)."""

    global_batch: int
    world: int
    per_chunk: int

    @property
    def chunks(self) -> Layout:
        """The global batch's chunks, in instances."""
        return Layout(self.global_batch, self.per_chunk)

    def share(self, rank: int) -> int:
        """Instances rank ``rank`` takes."""
        return sum(self.chunks.chunk(slot) for slot in self.chunks.slots(rank, self.world))

    @property
    def chunks_per_rank(self) -> int:
        """The most chunks a rank takes."""
        return len(self.chunks.slots(0, self.world))

    @property
    def rows_per_rank(self) -> int:
        """The most rows (two views an instance) a rank contributes."""
        return 2 * max(self.share(r) for r in range(self.world))

    def chunk_rows(self, configured: int) -> int:
        """Rows a rank encodes at a time: ``train.chunk_size`` when set; else, where a rank
        takes more than one chunk, a chunk's rows; 0 (the whole share at once) otherwise."""
        if configured:
            return configured
        return 2 * self.per_chunk if self.chunks_per_rank > 1 else 0

    def pieces(self, chunk_rows: int) -> tuple[int, int]:
        """(pieces a chunk is encoded in, pieces every rank encodes) at ``chunk_rows``."""
        splits = max(1, math.ceil(2 * self.per_chunk / chunk_rows))
        return splits, splits * self.chunks_per_rank

    def describe(self, configured_chunk: int) -> str:
        counts = sorted({len(self.chunks.slots(r, self.world)) for r in range(self.world)})
        chunk = self.chunk_rows(configured_chunk)
        return (f"global batch {self.global_batch} on {self.world} rank(s): "
                f"{' or '.join(map(str, counts))} chunk(s) of {self.per_chunk} instances a "
                "rank" + (f", encoded in pieces of at most {chunk} rows" if chunk else
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
