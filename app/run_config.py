"""The run configuration: every component's dataclass, composed into one tree, and what
each stage needs of it.

Each section is defined next to the code it configures and imported here; a YAML file
under ``launch/configs/`` sets any subset, ``key=value`` arguments override it. Library
defaults are neutral (no data paths); a value a stage needs and lacks fails before any
work, naming the key (:func:`check_stage`).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.cli import parse_stage_args
from core.config import ConfigError, InvalidValue
from data_pipeline.config import DataConfig, ShardsConfig
from data_pipeline.graph.config import GraphConfig
from data_pipeline.graph.tasks import check_task
from data_pipeline.loader.backends import backend_spec
from data_pipeline.sources import check_source
from evaluation.config import EvalConfig
from pretrain.distributed.engine import EngineConfig
from pretrain.loop.optim import OptimConfig
from pretrain.loop.trainer import TrainConfig
from pretrain.model.backbones import backbone_spec
from pretrain.model.encoder import ModelConfig
from pretrain.objectives.config import ObjectiveConfig
from pretrain.run.checkpoint import CheckpointConfig
from pretrain.run.preemption import PreemptionConfig
from pretrain.run.tracking import TrackingConfig
from serving.export import ExportConfig


@dataclass
class RunConfig:
    """Top level of a run: its name, seed, where it writes, and the component sections."""

    name: str = ""  # the run's directory under output_dir, and its MLflow run name
    seed: int = 0  # seed of model initialisation and everything seeded from it
    output_dir: str = "runs"  # parent directory of run directories
    shards: ShardsConfig = field(default_factory=ShardsConfig)  # make-shards
    data: DataConfig = field(default_factory=DataConfig)  # the loaders
    graph: GraphConfig = field(default_factory=GraphConfig)  # graph-precompute
    model: ModelConfig = field(default_factory=ModelConfig)  # encoder and projector
    optim: OptimConfig = field(default_factory=OptimConfig)  # optimiser and schedule
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)  # the loss
    engine: EngineConfig = field(default_factory=EngineConfig)  # DDP or DeepSpeed
    train: TrainConfig = field(default_factory=TrainConfig)  # the training loop
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)  # checkpoints
    preemption: PreemptionConfig = field(default_factory=PreemptionConfig)  # stop on a signal
    tracking: TrackingConfig = field(default_factory=TrackingConfig)  # MLflow
    eval: EvalConfig = field(default_factory=EvalConfig)  # evaluate
    export: ExportConfig = field(default_factory=ExportConfig)  # export

    def validate(self) -> None:
        if "/" in self.name:
            raise InvalidValue("name", f"must be a name without '/', got {self.name!r}")
        if self.seed < 0:
            raise InvalidValue("seed", f"must be >= 0, got {self.seed}")
        if not self.model.image_size:  # resolved here, so every rebuild of the encoder
            self.model.image_size = self.data.resolution  # reads it from model.* alone
        if self.optim.layer_decay != 1 and not backbone_spec(self.model.backbone).layers:
            raise ConfigError(f"key 'optim.layer_decay': layer-wise decay needs a backbone "
                              f"that declares its layers (model.backbone=timm:<name>), not "
                              f"{self.model.backbone}; set it to 1")


REQUIRED = {
    "make-shards": ("shards.source", "shards.output"),
    "graph-precompute": ("graph.output",),
    "pretrain": ("name", "data.shards"),
    "evaluate": ("name", "eval.train_shards", "eval.test_shards"),
    "export": ("export.model", "export.format", "export.output"),
}


def _get(config: Any, key: str) -> Any:
    for part in key.split("."):
        config = getattr(config, part)
    return config


# what the table entries a stage uses need of their sections: (section, check)
ENTRY_CHECKS: dict[str, tuple[tuple[str, Callable[[RunConfig], None]], ...]] = {
    "make-shards": (("shards", lambda config: check_source(config.shards)),),
    "graph-precompute": (("graph", lambda config: check_task(config.graph)),),
    "pretrain": (("data", lambda config: backend_spec(config.data.backend).check(config.data)),),
}


def check_stage(config: RunConfig, stage: str) -> None:
    """Raise :class:`ConfigError` naming the first key ``stage`` needs and ``config`` lacks."""
    for key in REQUIRED[stage]:
        if _get(config, key) in (None, ""):
            raise ConfigError(f"key '{key}': {stage} needs a value (set it in the YAML file "
                              f"or as {key}=...)")
    for section, check in ENTRY_CHECKS.get(stage, ()):
        try:
            check(config)
        except InvalidValue as err:
            raise ConfigError(f"key '{section}.{err.field}': {err}") from None
    if stage == "pretrain":
        _check_training(config)


def _check_training(config: RunConfig) -> None:
    if config.train.chunk_size and config.model.split_views:
        raise ConfigError("key 'train.chunk_size': chunks cannot keep model.split_views' "
                          "per-view batch norm; set one of them off")
    objective = config.objective
    key, graph = objective.class_graph_key, objective.class_graph_path
    if key and not (graph or config.data.caption_store):
        raise ConfigError(f"key '{key}': {objective.name} needs soft targets: a class graph "
                          "(graph-precompute graph.task=class_graph) or data.caption_store")
    if key and graph and config.data.caption_store:
        raise ConfigError(f"key '{key}': {objective.name} takes its targets from a class graph "
                          "or from data.caption_store, not both; set one to \"\"")
    if config.data.caption_store:
        _check_store_centring(config.data.caption_store, config.graph.center)
    if config.train.knn_every:
        for key in ("eval.train_shards", "eval.test_shards"):
            if not _get(config, key):
                raise ConfigError(f"key '{key}': train.knn_every={config.train.knn_every} "
                                  "monitors kNN on the evaluation shards; set them")


META_LIMIT = 1 << 20  # a store's meta.json is a few hundred bytes


def _check_store_centring(store: str, center: bool) -> None:
    """The caption store was made as the run's ``graph.center`` says (its ``meta.json``; a
    store made before the key existed is uncentred). A store that cannot be read is left
    to the loader, which names what is wrong with it."""
    try:
        with open(Path(store) / "meta.json", "rb") as handle:
            text = handle.read(META_LIMIT + 1)  # bounded: the store is read, not trusted
        if len(text) > META_LIMIT:
            return
        made = bool(json.loads(text).get("center", False))
    except (OSError, ValueError, AttributeError, RecursionError):
        return
    if made != center:
        raise ConfigError(
            f"key 'graph.center': data.caption_store {store} was made with "
            f"graph.center={str(made).lower()}, this run says {str(center).lower()}; make the "
            "store with graph-precompute --config <this run's YAML>, or set "
            f"graph.center={str(made).lower()}")


def parse_run(stage: str, description: str, argv: Sequence[str] | None = None,
              add_arguments: Callable[[argparse.ArgumentParser], None] | None = None,
              ) -> tuple[RunConfig, argparse.Namespace]:
    """A stage's command line: the validated :class:`RunConfig` (or exit 2) and options."""
    return parse_stage_args(RunConfig, stage, description, argv, add_arguments,
                            check=lambda config: check_stage(config, stage))
