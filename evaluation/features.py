"""Feature extraction with the evaluation loader, distributed over ranks.

Every sample is read exactly once across ranks and workers (``eval_batches``); each rank
embeds its share. Sets rank 0 may hold (queries, monitors' subsets) are gathered to it
(:func:`extract`: uneven counts allowed, through the run's device in bounded chunks, since
NCCL takes device tensors only); the kNN bank is written to files by every rank and read by
rank 0 a block at a time (:func:`extract_bank`). Either way the rows are in key order, so
the result does not depend on the number of ranks.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from tqdm import tqdm

from core.collectives import (
    all_ranks_agree,
    barrier,
    gather_objects_to_main,
    gather_rows_to_main,
)
from data_pipeline.config import DataConfig
from data_pipeline.loader import eval_batches
from data_pipeline.shards import ShardSet
from evaluation.bank import Bank, BankWriter, open_bank
from registry.package import EmbeddingModel


@dataclass
class Features:
    keys: list[str]
    labels: Tensor  # [n] int64 (-1: unlabelled)
    backbone: Tensor  # [n, F] float32
    projector: Tensor  # [n, P] float32
    class_names: list[str]
    captions: list[str | None]  # [n] each sample's caption (None: the shard has none)


def up_to(batches: Iterator[dict[str, Any]], samples: int) -> Iterator[dict[str, Any]]:
    """``batches`` until they have held at least ``samples`` samples."""
    seen = 0
    for batch in batches:
        if seen >= samples:
            return
        seen += len(batch["keys"])
        yield batch


def in_lockstep(batches: Iterator[dict[str, Any]], empty: dict[str, Any],
                device: torch.device) -> Iterator[dict[str, Any]]:
    """This rank's ``batches``, then ``empty`` ones while any other rank still has a batch:
    every rank takes as many (one all-reduce per batch, on ``device``)."""
    for batch in itertools.chain(batches, itertools.repeat(None)):
        if all_ranks_agree(batch is None, device):
            return
        yield empty if batch is None else batch


def empty_batch(resolution: int) -> dict[str, Any]:
    """An evaluation batch of no images (a forward that only joins the collectives)."""
    return {"images": torch.empty(0, 3, resolution, resolution), "keys": [], "captions": [],
            "labels": torch.empty(0, dtype=torch.long)}


def feature_widths(model: EmbeddingModel) -> dict[str, int]:
    return {"backbone": model.encoder.feature_dim, "projector": model.encoder.embedding_dim}


@dataclass
class Embedded:
    """One batch's features."""

    keys: list[str]
    captions: list[str | None]
    labels: Tensor  # [b] int64
    backbone: Tensor  # [b, F] float32, CPU
    projector: Tensor  # [b, P] float32, CPU


@torch.no_grad()
def embedded(model: EmbeddingModel, data: DataConfig, shards: str, device: torch.device,
             rank: int = 0, world: int = 1, progress: bool = True, limit: int = 0,
             lockstep: bool = False) -> Iterator[Embedded]:
    """This rank's share of ``shards`` embedded, a batch at a time (with ``limit``: of the
    first ``limit // world`` samples each rank reads, a fixed subset for monitors).
    ``lockstep``: the encoder's forward is a collective (FSDP2 gathers its parameters), so
    every rank runs as many forwards as the rank with the most batches (:func:`in_lockstep`)."""
    cfg = dataclasses.replace(data, shards=shards)
    total = ShardSet.open(shards).total
    model = model.to(device).eval()
    per_rank = limit // world if limit else total
    bar = tqdm(total=min(per_rank, total // world), desc=f"features {shards}", unit="img",
               disable=not (progress and rank == 0), dynamic_ncols=True)
    batches = up_to(eval_batches(cfg, rank, world), per_rank)
    if lockstep:
        batches = in_lockstep(batches, empty_batch(cfg.resolution), device)
    for batch in batches:
        features, projections = model.encoder(batch["images"].to(device))
        yield Embedded(batch["keys"], batch["captions"], batch["labels"],
                       features.float().cpu(), projections.float().cpu())
        bar.update(len(batch["keys"]))
    bar.close()


def extract(model: EmbeddingModel, data: DataConfig, shards: str, device: torch.device,
            rank: int = 0, world: int = 1, progress: bool = True, limit: int = 0,
            transfer_mib: int = 64, lockstep: bool = False) -> Features | None:
    """Backbone and projector features of every sample of ``shards`` (``limit``,
    ``lockstep``: :func:`embedded`), on rank 0; None on the other ranks. Each rank keeps its
    own rows on the CPU and sends them to rank 0 through ``device`` in chunks of about
    ``transfer_mib`` MiB received. For sets rank 0 may hold (queries, monitors); the kNN
    bank is :func:`extract_bank`'s."""
    keys, captions, labels, backbone, projector = [], [], [], [], []
    for batch in embedded(model, data, shards, device, rank, world, progress, limit,
                          lockstep):
        keys += batch.keys
        captions += batch.captions
        labels.append(batch.labels)
        backbone.append(batch.backbone)
        projector.append(batch.projector)
    widths = feature_widths(model)
    local = {"labels": torch.cat(labels) if labels else torch.empty(0, dtype=torch.long)}
    for name, parts in (("backbone", backbone), ("projector", projector)):
        local[name] = torch.cat(parts) if parts else torch.empty(0, widths[name])
    row_bytes = 4 * (widths["backbone"] + widths["projector"]) + 8
    chunk_rows = max(1, transfer_mib * 2**20 // (row_bytes * world))
    gathered = {k: gather_rows_to_main(v, device, chunk_rows) for k, v in local.items()}
    all_keys, all_captions = gather_objects_to_main(keys), gather_objects_to_main(captions)
    if all_keys is None:
        return None
    order = sorted(range(len(all_keys)), key=all_keys.__getitem__)
    index = torch.tensor(order, dtype=torch.long)
    return Features([all_keys[i] for i in order], gathered["labels"][index],
                    gathered["backbone"][index], gathered["projector"][index],
                    ShardSet.open(shards).class_names, [all_captions[i] for i in order])


def extract_bank(model: EmbeddingModel, data: DataConfig, shards: str, device: torch.device,
                 directory: Path, rank: int = 0, world: int = 1,
                 progress: bool = True) -> Bank | None:
    """The features of every sample of ``shards`` as a :class:`~evaluation.bank.Bank` in
    ``directory`` (which every rank writes), opened on rank 0; None on the other ranks.
    No process holds the features; rank 0 reads every rank's keys once, to order them."""
    writer = BankWriter(directory, rank)
    for batch in embedded(model, data, shards, device, rank, world, progress):
        writer.add(batch.keys, batch.labels, {"backbone": batch.backbone,
                                              "projector": batch.projector})
    writer.close()
    barrier()  # every rank's files are complete
    if rank != 0:
        return None
    return open_bank(directory, world, feature_widths(model),
                     ShardSet.open(shards).class_names)
