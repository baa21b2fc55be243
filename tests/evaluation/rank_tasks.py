"""Work for the 2-rank gloo group: feature extraction of a shard set."""

from __future__ import annotations

from pathlib import Path

import torch

from data_pipeline.config import DataConfig
from evaluation.features import extract, extract_bank
from pretrain.model.encoder import Encoder, ModelConfig
from registry.package import EmbeddingModel


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


def bank_on_rank(shards: str, directory: str) -> dict | None:
    """``features_on_rank``'s model and loader, the features written as a bank in
    ``directory`` and read back by rank 0 (whole, to compare)."""
    import torch.distributed as dist

    torch.manual_seed(0)
    model = EmbeddingModel(Encoder(ModelConfig(projector_hidden=32, projector_dim=8)))
    data = DataConfig(batch_size=7, workers=0, resolution=16)
    bank = extract_bank(model, data, shards, torch.device("cpu"), Path(directory),
                        dist.get_rank(), dist.get_world_size(), progress=False)
    if bank is None:
        return None
    return {"labels": bank.labels, "backbone": bank.backbone[:],
            "projector": bank.projector[:], "class_names": bank.class_names}


def sharded_features_on_rank(shards: str) -> dict | None:
    """``features_on_rank`` with the encoder sharded by FSDP2 over the group, after one
    training forward and backward (no update: the weights stay those of one process), as
    the kNN monitor runs it mid-run: within ``whole_root``, every rank in lockstep."""
    import torch.distributed as dist

    from pretrain.distributed.engine import EngineConfig, build_engine, engine_spec
    from pretrain.loop.optim import OptimConfig, build_optimizer
    from pretrain.model.encoder import build_model
    from pretrain.objectives import ObjectiveConfig

    torch.manual_seed(0)
    encoder = Encoder(ModelConfig(projector_hidden=32, projector_dim=8))
    model = build_model(ModelConfig(projector_hidden=32, projector_dim=8),
                        ObjectiveConfig(), torch.device("cpu"))
    model.encoder.load_state_dict(encoder.state_dict())
    cfg = EngineConfig(name="fsdp2")
    engine_spec("fsdp2").prepare(model, cfg, "fp32")
    engine = build_engine(model, build_optimizer(model, OptimConfig(), 8), cfg,
                          torch.device("cpu"), 8)
    model.eval()  # batch-norm statistics untouched: the weights stay those of one process
    out = engine(torch.randn(4, 3, 16, 16))
    engine.backward(out.projections.square().mean())
    model.train()
    data = DataConfig(batch_size=7, workers=0, resolution=16)
    with engine.whole_root():
        feats = extract(EmbeddingModel(model.encoder), data, shards, torch.device("cpu"),
                        dist.get_rank(), dist.get_world_size(), progress=False, lockstep=True)
    if feats is None:
        return None
    return {"keys": feats.keys, "labels": feats.labels, "backbone": feats.backbone,
            "projector": feats.projector}


def lockstep_counts(batches: int) -> list[int]:
    """The sizes of the batches this rank runs in lockstep when it holds ``batches``."""
    from evaluation.features import in_lockstep

    mine = ({"keys": ["k"] * 3} for _ in range(batches))
    return [len(b["keys"]) for b in in_lockstep(mine, {"keys": []}, torch.device("cpu"))]
