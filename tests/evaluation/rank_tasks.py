"""Work for the 2-rank gloo group: feature extraction of a shard set."""

from __future__ import annotations

import torch

from data_pipeline.config import DataConfig
from evaluation.features import extract
from pretrain.model.encoder import Encoder, ModelConfig
from serving.model_registry import EmbeddingModel


def features_on_rank(shards: str, rank: int | None = None, world: int | None = None,
                     transfer_mib: int = 64) -> dict | None:
    import torch.distributed as dist

    rank = dist.get_rank() if rank is None else rank
    world = dist.get_world_size() if world is None else world
    torch.manual_seed(0)
    model = EmbeddingModel(Encoder(ModelConfig(projector_hidden=32, projector_dim=8)))
    data = DataConfig(batch_size=7, workers=0, resolution=16)  # gloo workers are daemons
    feats = extract(model, data, shards, torch.device("cpu"), rank, world, progress=False,
                    transfer_mib=transfer_mib)
    if feats is None:
        return None
    return {"keys": feats.keys, "labels": feats.labels, "backbone": feats.backbone,
            "projector": feats.projector}
