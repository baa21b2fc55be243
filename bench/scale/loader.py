"""The training stream at real cardinalities (``python -m bench.scale --part epochs`` and
``--part resume``; see ``python -m bench.scale``).

- ``epochs``: the epoch plan of CC12M's 12M samples in 1,200 shards at simulated worlds, a
  chunk a rank (positions only: every chunk slot's order enumerated, nothing read):
  samples delivered, distinct, repeated, left, batches per rank; and batch class mixing
  on ImageNet's 1,281,000 images listed class by class, written by make-shards shuffled and
  unshuffled, against i.i.d. sampling.
- ``resume``: real tar shards of tiny JPEGs, local and over HTTP: the time from a loader
  built at 10% and at 90% of an epoch to its first batch.
"""

from __future__ import annotations

import copy
import io
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from data_pipeline.loader.plan import EpochPlan, Layout, ShardOrder

LANES, BLOCK = 4, 512
CC12M_SHARDS = 1_200
IMAGENET_CLASSES, IMAGENET_PER_CLASS, IMAGENET_SHARD = 1_000, 1_281, 1_000


def rank_batches(plan: EpochPlan, slots: range) -> list[np.ndarray]:
    """The positions of each global batch's chunks ``slots`` (a rank's), in order."""
    chunks = [np.fromiter(plan.slot(c).positions(), np.int64).reshape(plan.batches, -1)
              for c in slots]
    return [np.concatenate([chunk[b] for chunk in chunks]) for b in range(plan.batches)]


def epoch_coverage(total: int, world: int, workers: int, per_chunk: int) -> dict[str, Any]:
    """A chunk a rank (``data.global_batch=per_rank``): every slot's order enumerated."""
    start = time.perf_counter()
    layout = Layout(per_chunk * world, per_chunk)
    plan = EpochPlan(total, 0, 0, LANES, BLOCK, [], layout)
    shards = ShardOrder([total // CC12M_SHARDS] * CC12M_SHARDS, 0, 0)
    pieces = max(len(list(shards.pieces(plan.slot(c).lane(lane))))
                 for c in range(layout.chunks) for lane in range(plan.slot(c).lanes))
    seen = np.zeros(total, np.int32)
    batches = []
    for rank in range(world):
        mine = rank_batches(plan, layout.slots(rank, world))
        batches.append(len(mine))
        for batch in mine:
            seen[batch] += 1
    seconds = time.perf_counter() - start
    return {"world": f"{world}x{workers}", "batch": per_chunk,
            "samples": total, "delivered": int(seen.sum()), "twice": int((seen > 1).sum()),
            "left": int((seen == 0).sum()), "global_batch": layout.per_batch,
            "batches_per_rank": sorted(set(batches)), "seconds": seconds,
            "max_shard_ranges_per_lane": pieces,
            "ms_per_rank": 1e3 * seconds / world}


def iid_distinct(classes: int, per_class: int, batch: int) -> float:
    """Expected distinct classes among ``batch`` draws without replacement."""
    total = classes * per_class
    missing = math.exp(math.lgamma(total - per_class + 1) - math.lgamma(total - per_class
                                                                       - batch + 1)
                       - math.lgamma(total + 1) + math.lgamma(total - batch + 1))
    return classes * (1 - missing)


def class_mixing(world: int, workers: int, per_chunk: int, shuffled: bool,
                 ranks: int = 64) -> dict[str, Any]:
    """Mean distinct classes per batch (the first ``ranks`` ranks' batches) on ImageNet
    listed class by class and written by make-shards."""
    from data_pipeline.make_shards import sample_order

    total = IMAGENET_CLASSES * IMAGENET_PER_CLASS
    items = sample_order(total, 0, shuffled)  # make-shards' own order
    counts = [IMAGENET_SHARD] * (total // IMAGENET_SHARD)
    counts[-1] += total - sum(counts)
    shard_starts = np.cumsum([0, *counts])
    epoch = ShardOrder(counts, 0, 0)
    label_at = np.empty(total, np.int32)  # label of each epoch position
    for k, shard in enumerate(epoch.order):
        source = items[shard_starts[shard]:shard_starts[shard + 1]]
        label_at[epoch.starts[k]:epoch.starts[k + 1]] = source // IMAGENET_PER_CLASS
    layout = Layout(per_chunk * world, per_chunk)
    plan = EpochPlan(total, 0, 0, LANES, BLOCK, [], layout)
    distinct = [len(np.unique(label_at[batch])) for rank in range(min(ranks, world))
                for batch in rank_batches(plan, layout.slots(rank, world))]
    iid = iid_distinct(IMAGENET_CLASSES, IMAGENET_PER_CLASS, per_chunk)
    return {"world": f"{world}x{workers}", "batch": per_chunk,
            "shards": "shuffled" if shuffled else "class-sorted",
            "distinct_classes": float(np.mean(distinct)), "iid": iid,
            "ratio": float(np.mean(distinct)) / iid, "batches": len(distinct)}


def tiny_shards(folder: Path, shards: int, per_shard: int) -> None:
    """``shards`` tars of ``per_shard`` 16 px JPEGs with labels, and their manifest."""
    from data_pipeline.formats import Sample
    from data_pipeline.manifest import Manifest, ShardInfo, file_sha256
    from data_pipeline.tario import write_shard

    if (folder / "manifest.json").is_file():
        return
    folder.mkdir(parents=True, exist_ok=True)
    payload = io.BytesIO()
    Image.new("RGB", (16, 16), (120, 30, 200)).save(payload, format="JPEG")
    infos = []
    for s in range(shards):
        path = folder / f"shard-{s:06d}.tar"
        samples = (Sample(f"s{s:05d}_{i:06d}", payload.getvalue(), "jpg", i % 10, f"c {i}")
                   for i in range(per_shard))
        count = write_shard(path, samples)
        infos.append(ShardInfo(path.name, count, path.stat().st_size, file_sha256(path)))
    Manifest("bench", infos, [str(c) for c in range(10)]).write(folder)


def first_batch_seconds(shards: str, world: int, fraction: float) -> dict[str, Any]:
    """Seconds from building rank 0's loader at ``fraction`` of an epoch to its first
    batch (one stream, in this process)."""
    from data_pipeline.config import DataConfig
    from data_pipeline.loader import LoaderState, train_batches
    from data_pipeline.loader.train import TrainStream
    from data_pipeline.shards import ShardSet

    cfg = DataConfig(shards=shards, batch_size=64, workers=0, resolution=16, augment="none")
    total = TrainStream(cfg, ShardSet.open(shards), 0, world).batches_per_epoch
    state = LoaderState(batches=int(fraction * total), layout=[64 * world, 64])
    start = time.perf_counter()
    next(iter(train_batches(cfg, 0, world, copy.deepcopy(state))))
    return {"fraction": fraction, "batch": state.batches, "of": total,
            "seconds": time.perf_counter() - start}


def resume_latency(workdir: Path, shards: int = 40, per_shard: int = 2_500,
                   world: int = 4) -> list[dict[str, Any]]:
    from tests.data_pipeline.remote import ShardServer

    folder = workdir / f"resume-{shards}x{per_shard}"
    tiny_shards(folder, shards, per_shard)
    rows = []
    server = ShardServer(folder).start()
    try:
        sources = {"local": str(folder),
                   "http": f"{server.url}/shard-{{000000..{shards - 1:06d}}}.tar"}
        for where, spec in sources.items():
            first_batch_seconds(spec, world, 0.0)  # warm the page cache and the counts
            for fraction in (0.1, 0.9):
                times = [first_batch_seconds(spec, world, fraction)["seconds"]
                         for _ in range(3)]
                rows.append({"source": where, "fraction": fraction,
                             "seconds": float(np.median(times)),
                             "samples": shards * per_shard, "world": world})
    finally:
        server.stop()
    return rows
