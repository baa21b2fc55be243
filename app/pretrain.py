"""``pretrain``: assemble a run from its config and train it.

    torchrun --nproc_per_node 2 -m app.pretrain --config launch/configs/demo.yaml

Rank 0 writes ``<output_dir>/<name>/`` (resolved config, checkpoints, MLflow store, logs),
tracks the run in MLflow and, at the end, logs the final checkpoint and registers the
encoder as a new version of ``tracking.registered_model``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shlex
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from app.run_config import RunConfig, parse_run
from core.cli import reported_faults
from core.collectives import all_ranks_agree, barrier, sum_over_ranks
from core.config import flatten, to_yaml
from core.elastic import agent_arguments, shared_store_warning
from core.errors import RunError
from core.runtime import Runtime, init_runtime, resolve_precision, shutdown, side_store
from data_pipeline.graph.class_graph import load_class_graph
from data_pipeline.loader import TrainLoader
from data_pipeline.loader.ledger import LedgerWriter, attempt_name, restart_count
from data_pipeline.shards import ShardSet
from data_pipeline.text import TextConfig
from pretrain.distributed.engine import build_engine, engine_spec
from pretrain.loop.optim import build_optimizer, optimizer_spec, warmup_cosine_in_samples
from pretrain.loop.reports import Reports
from pretrain.loop.step import Objective
from pretrain.loop.trainer import RunLength, Trainer
from pretrain.loop.utilisation import Utilisation, device_peak_tflops
from pretrain.model.activation_checkpointing import check_compilable
from pretrain.model.encoder import build_model
from pretrain.model.flops import encoder_flops
from pretrain.objectives import objective_spec
from pretrain.run.batch_cut import BatchCut, recorded_global_batch
from pretrain.run.checkpoint import Checkpointer, list_checkpoints, model_state_of
from pretrain.run.hang import HangWatch, report_hangs
from pretrain.run.preemption import MARKER, PREEMPTED_EXIT_STATUS, Preempted, PreemptionWatch
from pretrain.run.run_lock import RunLock
from pretrain.run.run_log import setup_logging
from pretrain.run.tracking import Tracker
from registry.package import ModelCard
from registry.versions import log_encoder
from serving.inputs import served_form

log = logging.getLogger("pretrain")
INTERRUPTED_EXIT_STATUS = 130  # 128 + SIGINT, as a shell reports Ctrl-C


def text_for(config: RunConfig) -> TextConfig | None:
    """An objective with a text tower has its captions tokenised in the loader workers with
    the tower's model."""
    return config.model.text if objective_spec(config.objective.name).text_tower else None


def class_graph_for(config: RunConfig, device: torch.device) -> torch.Tensor | None:
    """The class graph a soft-target objective takes its targets from, on ``device``."""
    path = config.objective.class_graph_path
    if not path:
        return None
    if not Path(path).is_file():
        raise RunError(f"{config.objective.class_graph_key}={path}: no such file (run "
                       "graph-precompute graph.task=class_graph)")
    return torch.from_numpy(load_class_graph(path)[0]).to(device)


def knn_monitor_for(config: RunConfig, rt: Runtime, sharded: bool):
    """The kNN monitor (``train.knn_every``); ``sharded``: the engine shards the encoder, so
    every rank runs as many forwards."""
    if not config.train.knn_every:
        return None
    from evaluation.monitor import KnnMonitor

    return KnnMonitor(config.data, config.eval, config.train.knn_samples, rt.device, rt.rank,
                      rt.world, lockstep=sharded)


def build_trainer(config: RunConfig, rt: Runtime, run_dir: Path, precision: str) -> Trainer:
    """The trainer of ``config`` on this rank, its parts built from their sections: model,
    engine, objective, loader, checkpointer, schedule, preemption watch and reports (rank
    0's MLflow run, started last, once every check has passed)."""
    objective, data = config.objective, config.data
    shards = ShardSet.open(data.shards, retry=data.retry)
    if objective_spec(objective.name).labels and not shards.class_names:
        raise RunError(f"objective.name={objective.name} needs class labels, and "
                       f"data.shards={data.shards} lists no classes (no manifest with class names)")
    cut = batch_cut(config, rt, run_dir)
    global_batch = cut.global_batch
    check_batch_cut(cut, config, shards.total)
    candidates = 2 * global_batch - 2  # other views an anchor can be contrasted with
    if objective.num_negatives is not None and objective.num_negatives >= candidates:
        log.warning("objective.num_negatives=%d is at least the %d candidates per anchor at "
                    "global batch %d: every candidate is used, as with null",
                    objective.num_negatives, candidates, global_batch)
    if config.checkpoint.format == "sharded" and \
            not engine_spec(config.engine.name).sharded_checkpoints:
        raise RunError(f"checkpoint.format=sharded: engine.name={config.engine.name} keeps "
                       "its own optimizer partitions; use checkpoint.format=full, or "
                       "engine.name=ddp or fsdp2")
    if engine_spec(config.engine.name).flat_partitions and \
            optimizer_spec(config.optim.name).per_layer:
        log.warning("optim.name=%s inside DeepSpeed ZeRO takes its per-layer rule over each "
                    "rank's flat parameter partition, not per layer: prefer optim.name=adamw "
                    "with engine.name=deepspeed (docs/training.md)", config.optim.name)
    graph = class_graph_for(config, rt.device)
    torch.manual_seed(config.seed)
    model = build_model(config.model, objective, rt.device, len(shards.class_names))
    if precision == "fp64":
        model.double()
    if config.train.compile:  # in place: parameter names, checkpoints and registry unchanged
        check_compilable(model.encoder.backbone, config.model.backbone,
                         config.model.activation_checkpointing)
        model.encoder.compile()
    engine_spec(config.engine.name).prepare(model, config.engine, precision)
    optimizer = build_optimizer(model, config.optim, global_batch)
    engine = build_engine(model, optimizer, config.engine, rt.device, 2 * data.batch_size)
    loader = TrainLoader(data, rt.rank, rt.world, text=text_for(config), device=rt.device,
                         global_batch=global_batch)
    length = RunLength(loader.samples_per_step, loader.samples_per_epoch,
                       config.train.epochs, config.train.max_steps)
    if rt.is_main:
        log.info(cut.describe(config.train.chunk_size))
    return Trainer(
        dataclasses.replace(config.train, chunk_size=cut.chunk_rows(config.train.chunk_size)),
        engine=engine,
        objective=Objective(objective, graph, len(shards.class_names) or None,
                            cut.rows_per_rank),
        loader=loader,
        checkpointer=Checkpointer(run_dir, config.checkpoint, rt.rank, rt.world, rt.device,
                                  global_batch, engine.optimizer_sharded, to_yaml(config)),
        schedule=warmup_cosine_in_samples(length.total_samples, length.samples_per_step,
                                          config.optim.warmup_steps),
        length=length, runtime=rt, precision=precision, cut=cut,
        preemption=PreemptionWatch(config.preemption, rt.device),
        hang=hang_watch_for(config, rt, run_dir),
        reports=Reports(ledger=ledger_for(config, rt, run_dir),
                        utilisation=utilisation_of(config, rt, precision),
                        knn=knn_monitor_for(config, rt, engine.shards_parameters),
                        tracker=tracker_for(config, rt, run_dir)))


def hang_watch_for(config: RunConfig, rt: Runtime, run_dir: Path) -> HangWatch | None:
    """``train.hang.enabled``: this rank's heartbeat in the job's store, its step timer and
    the collective timeout that follow the run (``pretrain/run/hang.py``)."""
    if not config.train.hang.enabled:
        return None
    return HangWatch(config.train.hang, rt.rank, rt.world, config.engine.collective_timeout,
                     run_dir, side_store(rt.rank, rt.world))


def tracker_for(config: RunConfig, rt: Runtime, run_dir: Path) -> Tracker | None:
    """Rank 0's MLflow run (``tracking.enabled``), started with the run's parameters."""
    if not (config.tracking.enabled and rt.is_main):
        return None
    tracker = Tracker(config.tracking, run_dir, config.name)
    tracker.start(flatten(config))
    return tracker


def utilisation_of(config: RunConfig, rt: Runtime, precision: str) -> Utilisation:
    """The encoder's FLOPs per view (counted once, on the meta device) and the peak of the
    run's devices, for ``train/tflops`` and ``train/mfu``."""
    flops = encoder_flops(config.model)
    peak = device_peak_tflops(rt.device, precision, flops)
    utilisation = Utilisation(flops.total, None if peak is None else peak * rt.world)
    if rt.is_main:
        log.info("encoder: %.4g GFLOP a view, forward and backward; peak %s",
                 flops.total / 1e9, "unknown (no train/mfu)" if peak is None else
                 f"{peak:g} TFLOP/s a device at {precision}")
    return utilisation


def batch_cut(config: RunConfig, rt: Runtime, run_dir: Path) -> BatchCut:
    """This world's cut of the run's global batch: the one its checkpoints record
    (``data.global_batch=kept``), else ``data.global_batch_size``, else ``data.batch_size``
    on every rank."""
    data, resume = config.data, config.checkpoint.resume
    recorded = 0
    if data.global_batch == "kept" and rt.is_main and resume != "never":
        recorded = recorded_global_batch(list_checkpoints(run_dir) if resume == "auto"
                                         else [Path(resume)])
    recorded = int(sum_over_ranks(recorded, rt.device))  # rank 0's
    return BatchCut(recorded or data.global_batch_size or data.batch_size * rt.world,
                    rt.world, data.batch_size)


def check_batch_cut(cut: BatchCut, config: RunConfig, samples: int) -> None:
    """The global batch fits the data set, and every rank has a share of it."""
    data = config.data
    per_step = cut.global_batch * data.samples_per_batch // data.batch_size
    kept = cut.global_batch != data.batch_size * cut.world
    if cut.chunks.chunks < cut.world:
        raise RunError(f"the run's global batch of {cut.global_batch} (recorded in its "
                       f"checkpoints) is {cut.chunks.chunks} chunk(s) of data.batch_size="
                       f"{data.batch_size}, and {cut.world} ranks need a chunk each: resume "
                       f"it on at most {cut.chunks.chunks} ranks, or with a smaller "
                       "data.batch_size, or with data.global_batch=per_rank")
    if samples < per_step:
        needs = (f"the run's global batch of {cut.global_batch} (recorded in its checkpoints)"
                 if kept else f"data.batch_size={data.batch_size} on {cut.world} ranks")
        raise RunError(f"{needs} needs {per_step} samples per step and data.shards="
                       f"{data.shards} holds {samples}: lower data.batch_size")


def ledger_for(config: RunConfig, rt: Runtime, run_dir: Path) -> LedgerWriter | None:
    """``data.ledger``: this rank's ledger, named by rank 0's start time (a collective)."""
    if not config.data.ledger:
        return None
    start_ms, restart = (int(sum_over_ranks(value if rt.is_main else 0, rt.device))
                         for value in (time.time_ns() // 1_000_000, restart_count()))
    return LedgerWriter(run_dir, attempt_name(start_ms, restart), rt.rank, rt.world)


def model_card(config: RunConfig, trainer: Trainer, name: str) -> ModelCard:
    """The registered version's card: objective, data, training and kNN numbers."""
    shards = ShardSet.open(config.data.shards, retry=config.data.retry)
    last = {k: round(v, 6) for k, v in trainer.last_row.items()
            if k in ("step", "loss", "pos_sim", "neg_sim", "effective_rank", "temperature")}
    return ModelCard(
        name=name, objective=flatten(config.objective),
        data={"shards": config.data.shards, "samples": shards.total,
              "classes": len(shards.class_names), "resolution": config.data.resolution,
              "global_batch": trainer.checkpointer.global_batch},
        training={"run": config.name, "seed": config.seed, "steps": trainer.step,
                  "world_size": trainer.runtime.world, "engine": config.engine.name,
                  "optimizer": config.optim.name, "lr": config.optim.lr,
                  "backbone": config.model.backbone, **{f"last.{k}": v for k, v in last.items()}},
        knn={k: round(v, 6) for k, v in trainer.last_knn.items()})


def whole_model(config: RunConfig, trainer: Trainer) -> torch.nn.Module:
    """The trained model, whole: the engine's own, or, when the engine shards it across
    ranks, a copy built on this rank's CPU from the final checkpoint (its full state, or
    its sharded state read whole here), so that only this rank materialises it."""
    if not trainer.engine.shards_parameters:
        return trainer.model
    shards = ShardSet.open(config.data.shards, retry=config.data.retry)
    model = build_model(config.model, config.objective, torch.device("cpu"),
                        len(shards.class_names))
    model.load_state_dict(model_state_of(trainer.checkpointer.checkpoints()[0])[1])
    return model


def finish_tracking(tracker: Tracker, config: RunConfig, trainer: Trainer,
                    run_dir: Path) -> None:
    """The run's artifacts (config, final checkpoint) and, with ``tracking.log_model``, the
    encoder as a new version of the registered model."""
    tracker.log_artifact(run_dir / "config.yaml")
    tracker.log_artifact(trainer.checkpointer.checkpoints()[0], "checkpoint")
    if config.tracking.log_model:
        name = config.tracking.registered_model or f"{config.name}-encoder"
        model = whole_model(config, trainer)
        card = model_card(config, trainer, name)
        classes = model.loss_parameters.get("class_embeddings")  # learned ones
        version = tracker.log_model(lambda uri, run_id: log_encoder(
            uri, run_id, model.encoder, name, trainer.checkpointer.config_yaml, card,
            served_form(), model.text, classes))
        if version is not None:
            log.info("registered model %s version %s", name, version)
    tracker.finish()


def train(config: RunConfig) -> Path:
    """Run (or resume) the configured training; returns the run directory."""
    rt = init_runtime(config.train.device, config.engine.backend,
                      need_group=(engine_spec(config.engine.name).process_group
                                  or config.engine.process_group),
                      collective_timeout_s=config.engine.collective_timeout)
    run_dir = Path(config.output_dir) / config.name
    created = not run_dir.exists()
    lock = lock_run_dir(run_dir, rt)
    setup_logging(rt, run_dir)
    shared_store = shared_store_warning(os.environ, agent_arguments())
    if shared_store and rt.is_main:
        log.warning(shared_store)
    try:
        precision = resolve_precision(config.train.precision, rt.device)
        try:
            trainer = build_trainer(config, rt, run_dir, precision)
        except RunError:  # nothing was trained: leave no stray run directory behind
            if rt.is_main and created:
                shutil.rmtree(run_dir, ignore_errors=True)
            raise
        if rt.is_main:
            (run_dir / "config.yaml").write_text(trainer.checkpointer.config_yaml)
            log.info("resolved config: %s", run_dir / "config.yaml")
            log.info("%d ranks on %s, %s; backend %s", rt.world, rt.device, precision,
                     dist.get_backend() if dist.is_initialized() else "none (one process)")
        run(trainer, config, run_dir)
        barrier()
    finally:
        if lock is not None:
            lock.release()
        shutdown()
    return run_dir


def run(trainer: Trainer, config: RunConfig, run_dir: Path) -> None:
    """Resume, train and finish tracking; whatever stops the run from here on marks its
    MLflow run FAILED, or KILLED with a marker file when a signal preempted it."""
    tracker, rt = trainer.reports.tracker, trainer.runtime
    try:
        trainer.resume()
        if rt.is_main:
            (run_dir / MARKER).unlink(missing_ok=True)
            report_hangs(run_dir, tracker)
        trainer.train()
        if tracker is not None:
            finish_tracking(tracker, config, trainer, run_dir)
    except Preempted as stop:  # checkpointed: KILLED and tagged, to be resumed
        if rt.is_main:
            (run_dir / MARKER).write_text(json.dumps(
                {"step": stop.step, "signal": stop.signal_name,
                 "checkpoint": stop.checkpoint}) + "\n")
            if tracker is not None:
                tracker.finish("KILLED", {"preempted": stop.signal_name,
                                          "preempted_at_step": str(stop.step)})
        raise
    except BaseException as stop:
        if tracker is not None:
            tracker.finish("FAILED")
        if isinstance(stop, KeyboardInterrupt):
            newest = trainer.checkpointer.checkpoints()
            raise Interrupted(trainer.step, str(newest[0]) if newest else "") from None
        raise


def lock_run_dir(run_dir: Path, rt: Runtime) -> RunLock | None:
    """Rank 0 creates ``run_dir`` and takes its lock (:mod:`pretrain.run.run_lock`); every rank
    stops with one line when another run holds it."""
    lock, refused = None, None
    if rt.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        try:
            lock = RunLock(run_dir)
            lock.acquire()
        except RunError as err:
            lock, refused = None, err
    if not all_ranks_agree(refused is None, rt.device):
        shutdown()
        raise refused or RunError(f"{run_dir} is in use by another run (rank 0 names it)")
    return lock


class Interrupted(Exception):  # noqa: N818 (a stop, not an error)
    """Ctrl-C: the run stopped at ``step``; ``checkpoint`` is the newest ("" for none)."""

    def __init__(self, step: int, checkpoint: str) -> None:
        super().__init__(f"interrupted at step {step}")
        self.step, self.checkpoint = step, checkpoint


def main(argv: Sequence[str] | None = None) -> None:
    config, _ = parse_run("pretrain", __doc__, argv)
    try:
        with reported_faults("pretrain"):
            train(config)
    except Preempted as stop:
        sys.stderr.write(f"pretrain: {stop}; the same command resumes it\n")
        raise SystemExit(PREEMPTED_EXIT_STATUS) from None
    except (Interrupted, KeyboardInterrupt) as stop:
        command = shlex.join(["pretrain", *(sys.argv[1:] if argv is None else argv)])
        if isinstance(stop, Interrupted):
            where = (f"interrupted at step {stop.step}; newest checkpoint "
                     f"{stop.checkpoint or 'none yet'}")
        else:  # before training began
            where = "interrupted before the first step"
        sys.stderr.write(f"pretrain: {where}; the same command resumes it: {command}\n")
        raise SystemExit(INTERRUPTED_EXIT_STATUS) from None


if __name__ == "__main__":
    main()
