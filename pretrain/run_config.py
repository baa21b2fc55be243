"""The run configuration: every component's dataclass, composed into one tree.

Each section is defined next to the code it configures and imported here; a YAML file
under ``launch/configs/`` sets any subset, ``key=value`` arguments override it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from data_pipeline.config import DataConfig, ShardsConfig
from data_pipeline.graph.config import GraphConfig
from evaluation.config import EvalConfig
from pretrain.checkpoint import CheckpointConfig
from pretrain.config import InvalidValue
from pretrain.engine import EngineConfig
from pretrain.losses.config import ObjectiveConfig
from pretrain.model import ModelConfig
from pretrain.optim import OptimConfig
from pretrain.tracking import TrackingConfig
from pretrain.trainer import TrainConfig


@dataclass
class RunConfig:
    """Top level of a run: its name, seed, where it writes, and the component sections."""

    name: str = "digits-xclr-demo"
    seed: int = 0
    output_dir: str = "runs"
    shards: ShardsConfig = field(default_factory=ShardsConfig)
    data: DataConfig = field(default_factory=DataConfig)
    graph: GraphConfig = field(default_factory=GraphConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def validate(self) -> None:
        if not self.name or "/" in self.name:
            raise InvalidValue("name", f"must be a non-empty name without '/', got {self.name!r}")
        if self.seed < 0:
            raise InvalidValue("seed", f"must be >= 0, got {self.seed}")
        objective = self.objective
        if objective.name == "xclr" and not (objective.class_graph or self.data.caption_store):
            raise InvalidValue("objective.class_graph", "xclr needs soft targets: a class "
                               "graph (graph-precompute graph.task=class_graph) or "
                               "data.caption_store")

