"""``pretrain``: assemble a run from its config and train it (issue #4).

    torchrun --nproc_per_node 2 -m pretrain.train --config launch/configs/demo.yaml

Rank 0 writes ``<output_dir>/<name>/`` (resolved config, checkpoints, MLflow store, logs),
tracks the run in MLflow and, at the end, logs the final checkpoint and registers the
encoder as a new version of ``tracking.registered_model``.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from pathlib import Path

import torch

from data_pipeline.config import DataConfig
from data_pipeline.graph.class_graph import load_class_graph
from data_pipeline.samples import ShardSet
from pretrain.checkpoint import Checkpointer
from pretrain.cli import stage_main
from pretrain.config import flatten, to_yaml
from pretrain.distributed import barrier
from pretrain.engine import build_engine
from pretrain.losses import objective_from_config
from pretrain.model import build_model
from pretrain.optim import build_optimizer, warmup_cosine
from pretrain.run_config import RunConfig
from pretrain.runtime import Runtime, init_runtime, resolve_precision, shutdown
from pretrain.tracking import Tracker
from pretrain.trainer import Parts, Trainer

log = logging.getLogger("pretrain")


def setup_logging(rt: Runtime, run_dir: Path) -> None:
    level = logging.INFO if rt.is_main else logging.WARNING
    fmt = f"%(asctime)s rank{rt.rank} %(name)s %(levelname)s: %(message)s"
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if rt.is_main:
        handlers.append(logging.FileHandler(run_dir / "train.log"))
    logging.basicConfig(level=level, format=fmt, handlers=handlers, force=True)


def data_for(config: RunConfig) -> DataConfig:
    """The loader config, tokenising captions in the workers when CLIP needs text."""
    if config.objective.name != "clip":
        return config.data
    return dataclasses.replace(config.data, tokenizer=config.model.text.model,
                               text_length=config.model.text.max_length)


def build_parts(config: RunConfig, rt: Runtime, run_dir: Path) -> Parts:
    torch.manual_seed(config.seed)
    objective = config.objective
    model = build_model(config.model, rt.device, with_text=objective.name == "clip",
                        learnable_temperature=(objective.temperature
                                               if objective.learnable_temperature else None))
    data = data_for(config)
    global_batch = data.batch_size * rt.world
    optimizer = build_optimizer(model, config.optim, global_batch)
    engine = build_engine(model, optimizer, config.engine, rt.device, 2 * data.batch_size)
    per_epoch = ShardSet.open(data.shards).total // global_batch
    total = config.train.max_steps or config.train.epochs * per_epoch
    graph = None
    if objective.name == "xclr" and objective.class_graph:
        if not Path(objective.class_graph).is_file():
            raise FileNotFoundError(f"objective.class_graph={objective.class_graph}: no such "
                                    "file (run graph-precompute graph.task=class_graph)")
        graph = torch.from_numpy(load_class_graph(objective.class_graph)[0]).to(rt.device)
    monitor = None
    if config.train.knn_every:
        from evaluation.monitor import KnnMonitor

        monitor = KnnMonitor(data, config.eval, config.train.knn_samples, rt.device, rt.rank,
                             rt.world)
    return Parts(engine=engine, monitor=monitor, objective=objective_from_config(objective),
                 objective_cfg=objective, data_cfg=data, runtime=rt,
                 checkpointer=Checkpointer(run_dir, config.checkpoint, rt.rank, rt.world,
                                           rt.device),
                 schedule=warmup_cosine(total, config.optim.warmup_steps), total_steps=total,
                 class_graph=graph, config_yaml=to_yaml(config))


def finish_tracking(tracker: Tracker, config: RunConfig, parts: Parts, run_dir: Path) -> None:
    tracker.log_artifact(run_dir / "config.yaml")
    last = parts.checkpointer.checkpoints()[0]
    tracker.log_artifact(last, "checkpoint")
    if config.tracking.log_model:
        size = config.data.resolution
        example = torch.zeros(2, 3, size, size)
        name = config.tracking.registered_model or f"{config.name}-encoder"
        version = tracker.log_model(parts.engine.module.encoder, example, name)
        if version is not None:
            log.info("registered model %s version %s", name, version)
    tracker.finish()


def train(config: RunConfig) -> Path:
    """Run (or resume) the configured training; returns the run directory."""
    rt = init_runtime(config.train.device, config.engine.backend,
                      need_group=config.engine.name == "deepspeed")
    run_dir = Path(config.output_dir) / config.name
    if rt.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
    barrier()
    setup_logging(rt, run_dir)
    try:
        parts = build_parts(config, rt, run_dir)
        precision = resolve_precision(config.train.precision, rt.device)
        if rt.is_main:
            (run_dir / "config.yaml").write_text(parts.config_yaml)
            log.info("resolved config:\n%s", parts.config_yaml)
            log.info("%d ranks on %s, %s, %d steps", rt.world, rt.device, precision,
                     parts.total_steps)
            if config.tracking.enabled:
                parts.tracker = Tracker(config.tracking, run_dir, config.name)
                parts.tracker.start(flatten(config))
        trainer = Trainer(config.train, parts, precision)
        trainer.resume()
        trainer.run()
        if parts.tracker is not None:
            finish_tracking(parts.tracker, config, parts, run_dir)
        barrier()
    finally:
        shutdown()
    return run_dir


main = stage_main("pretrain", __doc__, train)

if __name__ == "__main__":
    main()
