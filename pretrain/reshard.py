"""Resuming a checkpoint on another number of ranks (replicated optimizer state: DDP).

The model, optimizer, step, schedules and ESS controller are in ``shared.pt`` and load
unchanged on any number of ranks. What is per rank is rebuilt for the new world:

- Data: the epoch continues from the same number of samples. The old run delivered
  ``b`` batches per rank at global batch ``G`` (ranks x per-rank batch), ``b * G``
  samples of the epoch; the new ranks continue at batch ``floor(b * G / G')`` of the new
  layout, so no part of the epoch is skipped, and when ``b * G`` is not a multiple of
  ``G'`` less than one global batch of the epoch is drawn again. (The same holds when
  only the batch size changes.) Streams are seeded per rank and
  world, so the samples after the resume are new draws from the same shards (the
  training stream samples shards with replacement), not the ones the old ranks would
  have drawn. The replay list of undecodable samples belongs to the old streams and is
  dropped.
- Skip counts: the old ranks' totals are summed into the new rank 0, so the run's
  totals continue.
- Random number generators: every new rank is seeded from (step, rank).
"""

from __future__ import annotations

from typing import Any


def batches_done(batches: int, old_global: int, new_global: int) -> int:
    """Per-rank batches of the new layout that cover at most the ``batches * old_global``
    samples the old run consumed in the epoch (less than one global batch short)."""
    return batches * old_global // new_global


def loader_state_for(loaders: list[dict[str, Any]], rank: int, old_global: int,
                     new_global: int) -> dict[str, Any]:
    """The loader state of new ``rank`` from the states of the ranks that wrote the
    checkpoint (``loaders[r]`` of old rank ``r``) at global batch ``old_global``."""
    first = loaders[0]
    loader: dict[str, Any] = {"epoch": first["epoch"],
                              "batches": batches_done(first["batches"], old_global, new_global),
                              "bad_keys": [], "skipped": {}, "skipped_places": {},
                              "skipped_examples": []}
    if rank == 0:
        for old in loaders:
            for name in ("skipped", "skipped_places"):
                for key, count in old.get(name, {}).items():
                    loader[name][key] = loader[name].get(key, 0) + count
            loader["skipped_examples"] += old.get("skipped_examples", [])
    return loader
