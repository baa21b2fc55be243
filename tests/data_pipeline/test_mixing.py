"""Batches from a class-sorted image tree hold as many classes as i.i.d. sampling would:
make-shards writes the tree in a seeded random order and the stream reads several places
of the data set at once."""

from __future__ import annotations

import numpy as np

from data_pipeline.config import DataConfig, ShardsConfig
from data_pipeline.loader import train_batches
from data_pipeline.make_shards import make_shards
from tests.data_pipeline.helpers import save_image

CLASSES, PER_CLASS, BATCH = 100, 30, 64


def iid_distinct(rng: np.random.Generator, draws: int = 4000) -> float:
    """Mean distinct classes of BATCH samples drawn without replacement from the tree."""
    labels = np.repeat(np.arange(CLASSES), PER_CLASS)
    return float(np.mean([len(np.unique(rng.choice(labels, BATCH, replace=False)))
                          for _ in range(draws)]))


def distinct_per_batch(shards, world: int = 2, **kw) -> float:
    cfg = DataConfig(shards=str(shards), batch_size=BATCH, workers=0, resolution=8,
                     augment="none", **kw)
    counts = [len(set(b["labels"][:BATCH].tolist()))
              for rank in range(world) for b in train_batches(cfg, rank, world)]
    return float(np.mean(counts))


def test_a_class_sorted_tree_gives_batches_as_mixed_as_iid(tmp_path):
    root = tmp_path / "train"
    for c in range(CLASSES):  # listed class by class, as an ImageNet folder tree is
        for j in range(PER_CLASS):
            save_image(root / f"n{c:03d}" / f"{j}.JPEG", c * PER_CLASS + j)
    cfg = ShardsConfig(source="imagenet", input=str(root), output=str(tmp_path / "s"),
                       shard_size=300, workers=2)
    make_shards(cfg)
    iid = iid_distinct(np.random.default_rng(0))
    assert 47 < iid < 48  # 64 draws of 100 classes x 30
    got = distinct_per_batch(tmp_path / "s")
    assert got >= 0.9 * iid, (got, iid)
