"""A cheap kNN monitor for training: backbone kNN top-1 (k = 20) of a fixed subset of the
evaluation shards against a fixed subset of the training shards, every
``train.knn_every`` steps. Every rank calls it (feature extraction is distributed); rank 0
computes the number, the other ranks return ``{}``. Under FSDP2 (``lockstep``) every rank
runs as many forwards of the sharded encoder, within the engine's ``whole_root``."""

from __future__ import annotations

import dataclasses

import torch

from data_pipeline.config import DataConfig
from evaluation.config import EvalConfig
from evaluation.features import extract
from evaluation.knn import build_index, knn_accuracy
from registry.package import EmbeddingModel


class KnnMonitor:
    def __init__(self, data: DataConfig, cfg: EvalConfig, samples: int, device: torch.device,
                 rank: int, world: int, lockstep: bool = False) -> None:
        self.data = dataclasses.replace(data, workers=0)  # same subset every time
        self.cfg, self.samples = cfg, samples
        self.device, self.rank, self.world = device, rank, world
        self.lockstep = lockstep  # the encoder is sharded: its forward is a collective

    def __call__(self, encoder: torch.nn.Module) -> dict[str, float]:
        """{"knn_top1": ...} on rank 0, {} on the others."""
        was_training = encoder.training
        model = EmbeddingModel(encoder)
        bank, queries = (extract(model, self.data, shards, self.device, self.rank, self.world,
                                 progress=False, limit=self.samples, lockstep=self.lockstep)
                         for shards in (self.cfg.train_shards, self.cfg.test_shards))
        encoder.train(was_training)
        if bank is None or queries is None:
            return {}
        classes = max(len(bank.class_names), int(bank.labels.max()) + 1)
        result, _ = knn_accuracy(build_index(bank.backbone, "exact"), bank.labels,
                                 queries.backbone, queries.labels, [20],
                                 self.cfg.knn_temperature, classes)
        return {"knn_top1": result["k20"]["top1"]}
