"""The ceiling: a supervised cross-entropy encoder of the same architecture, trained on the
same views (each view a labelled example) with the same optimiser and schedule."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from bench.common import write_json
from bench.learning.data import DataSet
from bench.learning.runs import Configuration, evaluate, result_path, run_config
from bench.records import invocation, provenance
from data_pipeline.loader import LoaderState, train_batches
from data_pipeline.shards import ShardSet
from pretrain.loop.optim import build_optimizer, warmup_cosine
from pretrain.model.encoder import Encoder
from registry.package import EmbeddingModel


def train_cross_entropy(conf: Configuration, data: DataSet, root: Path) -> dict[str, Any]:
    path = result_path(conf, root)
    if path.is_file():
        return json.loads(path.read_text())
    seen = provenance(invocation())  # the tree the run starts from
    config, _ = run_config(conf, data, root)
    torch.manual_seed(config.seed)
    encoder = Encoder(config.model)
    classes = len(ShardSet.open(config.data.shards).class_names)
    model = torch.nn.ModuleDict({"encoder": encoder,
                                 "head": torch.nn.Linear(encoder.feature_dim, classes)})
    batch = config.data.batch_size * 2  # the pretrain runs' global batch (2 ranks)
    loader_cfg = dataclasses.replace(config.data, batch_size=batch)
    optimizer = build_optimizer(model, config.optim, batch)
    steps = config.train.max_steps or \
        config.train.epochs * (ShardSet.open(config.data.shards).total // batch)
    schedule = warmup_cosine(steps, config.optim.warmup_steps)
    base = [group["lr"] for group in optimizer.param_groups]
    state, step, start = LoaderState(), 0, time.perf_counter()
    bar = tqdm(total=steps, desc=conf.name, unit="step", leave=False)
    while step < steps:
        for item in train_batches(loader_cfg, state=state):
            for group, lr in zip(optimizer.param_groups, base, strict=True):
                group["lr"] = lr * schedule(step)
            features, _ = encoder(item["images"])
            loss = torch.nn.functional.cross_entropy(model["head"](features), item["labels"])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            bar.update()
            if step >= steps:
                break
    bar.close()
    result = {"configuration": dataclasses.asdict(conf),
              "training": {"seconds": time.perf_counter() - start, "steps": steps,
                           "last_loss": loss.item()},
              "evaluation": evaluate(EmbeddingModel(encoder.eval()), config, data,
                                     path.parent / "eval")}
    write_json(path, result, seen)
    return json.loads(path.read_text())  # as a later report reads it: its provenance too
