"""The training loop: steps, non-finite guard, monitors, checkpoints, progress.

Per step: set the learning rate from the schedule, forward under autocast, build the
global batch and the objective (:func:`pretrain.loop.step.forward_loss`), then backward and
update through the engine. A non-finite loss on any rank skips the update on every rank
and is counted; ``max_nonfinite`` in a row stops the run with a message. The metrics, the
finite check and the skip stay on the device (:mod:`pretrain.loop.device_metrics`): under DDP
the host reads them once per ``log_every`` steps, when the training monitors (averaged
over ranks and steps) go to MLflow and the progress bar; DeepSpeed's step decides on the
host. Checkpoints follow :mod:`pretrain.run.checkpoint`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from tqdm import tqdm

from core.collectives import mean_over_ranks_on_device, sum_over_ranks, totals_over_ranks
from core.config import InvalidValue
from core.runtime import Runtime, autocast, peak_memory_mib
from data_pipeline.config import DataConfig
from data_pipeline.loader import LoaderState, TrainLoader
from data_pipeline.samples import SKIP_REASONS
from data_pipeline.text import TextConfig
from pretrain.loop.chunked import chunked_forward_loss
from pretrain.loop.collapse import CollapseConfig, CollapseWatch
from pretrain.loop.device_metrics import (
    MetricWindow,
    NonFiniteGuard,
    StepFlags,
    agreed_flags,
    kept_buffers,
)
from pretrain.loop.engine import Engine
from pretrain.loop.step import BatchSpec, forward_loss, to_device
from pretrain.losses import EssTemperatureController, ObjectiveConfig
from pretrain.run.checkpoint import Checkpointer, rng_state, set_rng_state
from pretrain.run.config_drift import check_drift, unfit_checkpoint
from pretrain.run.preemption import Preempted, PreemptionWatch

log = logging.getLogger(__name__)


@dataclass
class TrainConfig:
    """``train.*``: length of the run and how it is watched."""

    epochs: int = 1  # passes over the training shards
    max_steps: int = 0  # > 0: stop after this many steps (overrides epochs)
    log_every: int = 10  # steps between metric rows
    precision: Literal["auto", "fp32", "bf16"] = "auto"  # auto: bf16 autocast on GPU
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto: cuda when available
    max_nonfinite: int = 5  # consecutive non-finite losses that stop the run
    chunk_size: int = 0  # > 0: encode in chunks of this many rows, cached gradient (GradCache)
    compile: bool = False  # torch.compile the encoder (docs/training.md, "Compiled step")
    progress: bool = True  # tqdm bar on rank 0
    knn_every: int = 0  # > 0: kNN monitor on a fixed subset of eval.* shards every N steps
    knn_samples: int = 2000  # size of that subset (bank and queries each)
    collapse: CollapseConfig = field(default_factory=CollapseConfig)  # collapse detection

    def validate(self) -> None:
        for key in ("epochs", "log_every", "max_nonfinite"):
            if getattr(self, key) < 1:
                raise InvalidValue(key, f"must be >= 1, got {getattr(self, key)}")
        for key in ("max_steps", "knn_every", "chunk_size"):
            if getattr(self, key) < 0:
                raise InvalidValue(key, f"must be >= 0, got {getattr(self, key)}")


@dataclass
class Parts:
    """What the loop drives, assembled by :mod:`app.pretrain`."""

    engine: Engine
    objective: Callable
    objective_cfg: ObjectiveConfig
    data_cfg: DataConfig
    text: TextConfig | None  # tokenise captions with this model (clip)
    runtime: Runtime
    checkpointer: Checkpointer
    schedule: Callable[[int], float]
    total_steps: int
    batch_spec: BatchSpec = field(default_factory=BatchSpec)  # class graph, C, rows
    tracker: Any = None  # pretrain.run.tracking.Tracker on rank 0
    monitor: Callable[[torch.nn.Module], dict[str, float]] | None = None  # kNN monitor
    config_yaml: str = ""
    preemption: PreemptionWatch | None = None  # stop with a checkpoint on a signal


class Trainer:
    def __init__(self, cfg: TrainConfig, parts: Parts, precision: str) -> None:
        self.cfg, self.p, self.precision = cfg, parts, precision
        self.step = 0
        self.loader_state = LoaderState()
        self.guard = NonFiniteGuard(cfg.max_nonfinite, parts.runtime.device)
        ess = parts.objective_cfg.ess_control
        self.controller = (EssTemperatureController(ess, parts.objective_cfg.temperature)
                           if ess.enabled else None)
        self.collapse = CollapseWatch(cfg.collapse)
        self.window = MetricWindow()  # on the device until reported
        self.views, self.window_start = 0, time.perf_counter()
        self.last_saved = -1
        self.last_row: dict[str, float] = {}  # the newest logged metrics (all ranks' mean)
        self.last_knn: dict[str, float] = {}  # the newest kNN monitor result
        self.empty_steps: torch.Tensor | int = 0  # steps with a placeholder batch, unreported

    # -- state ------------------------------------------------------------------------
    def save(self) -> Path:
        engine = self.p.engine.state_dict()
        world = self.p.runtime.world
        shared = {"step": self.step, "world": world, "model": engine["model"],
                  "global_batch": self.p.data_cfg.batch_size * world,
                  "nonfinite_total": self.guard.check(self.step), "config": self.p.config_yaml,
                  "controller": self.controller.state_dict() if self.controller else {},
                  "collapse": self.collapse.state_dict()}
        own = {"rng": rng_state(), "loader": self.loader_state.state_dict()}
        (own if self.p.engine.optimizer_sharded else shared)["optimizer"] = engine["optimizer"]
        path = self.p.checkpointer.save(self.step, shared, own)
        self.last_saved = self.step
        log.info("checkpoint: %s", path)
        return path

    def resume(self) -> bool:
        loaded = self.p.checkpointer.load()
        if loaded is None:
            return False
        shared, own, path = loaded
        check_drift(path, shared.get("config", ""), self.p.config_yaml,
                    self.p.checkpointer.cfg.allow_changes)
        state = {"model": shared["model"]}
        if "optimizer_partitions" in own:  # ZeRO partitions of another number of ranks
            state["optimizer_partitions"] = own["optimizer_partitions"]
        else:
            state["optimizer"] = (own if self.p.engine.optimizer_sharded else shared)["optimizer"]
        try:
            self.p.engine.load_state_dict(state)
        except RuntimeError as err:  # tensors of another model: name what changed
            raise unfit_checkpoint(path, shared.get("config", ""), self.p.config_yaml,
                                   err) from None
        self.step = self.last_saved = shared["step"]
        self.guard.total = shared["nonfinite_total"]
        if self.controller:
            self.controller.load_state_dict(shared["controller"])
        self.collapse.load_state_dict(shared.get("collapse", {}))
        self.loader_state = LoaderState.from_state_dict(own["loader"])
        set_rng_state(own["rng"])
        log.info("resumed from %s at step %d", path, self.step)
        return True

    # -- loop -------------------------------------------------------------------------
    def run(self) -> None:
        rt = self.p.runtime
        bar = tqdm(total=self.p.total_steps, initial=self.step, unit="step",
                   disable=not (self.cfg.progress and rt.is_main), dynamic_ncols=True)
        self.window_start = time.perf_counter()
        if self.cfg.chunk_size and rt.is_main:
            log.info("encoder runs in chunks of at most %d rows per rank, with the cached "
                     "embedding gradient (train.chunk_size)", self.cfg.chunk_size)
        loader = TrainLoader(self.p.data_cfg, rt.rank, rt.world, self.loader_state, self.p.text,
                             rt.device)
        try:
            with self.p.preemption or contextlib.nullcontext():
                while self.step < self.p.total_steps:
                    for batch in loader.epoch():
                        self.train_step(batch, bar)
                        if self.step >= self.p.total_steps:
                            break
        finally:
            loader.close()
            bar.close()
        if self.last_saved != self.step:
            self.save()
        self.report_skips()

    def report_skips(self) -> None:
        """The run's skipped samples: each rank logs its own (per reason and shard, with
        examples); rank 0 sends the totals per reason to MLflow."""
        rt, state = self.p.runtime, self.loader_state
        summary = state.summary()
        if summary:
            log.warning("rank %d data: %s", rt.rank, summary)
        totals = totals_over_ranks({f"skipped.{reason}": state.skipped.get(reason, 0)
                                    for reason in SKIP_REASONS}, rt.device)
        if rt.is_main:
            log.info("data: skipped per reason over all ranks: %s",
                     {k.split(".")[1]: int(v) for k, v in totals.items() if v} or "none")
            if self.p.tracker is not None:
                self.p.tracker.log_metrics(self.step, totals)

    def train_step(self, batch: dict[str, Any], bar: tqdm) -> None:
        p, rt = self.p, self.p.runtime
        placeholder = bool(batch.get("placeholder", False))  # the loader's, on the host
        batch = to_device(batch, rt.device)
        lr = p.engine.set_lr(p.schedule(self.step))
        with kept_buffers(p.engine.module, placeholder):
            out, flags = self._forward_and_update(batch, placeholder)
        if self.controller:
            self.controller.update(mean_over_ranks_on_device(out.metrics["ess"]),
                                   self.step / max(1, p.total_steps))
        self.step += 1
        self.window.add(out.metrics, flags.real)
        self.views += 0 if placeholder else len(batch["images"])
        bar.update(1)
        if self.reports_after(self.step):
            self._report(bar, lr)
        if p.monitor is not None and self.step % self.cfg.knn_every == 0:
            self._monitor()
        if p.checkpointer.due(self.step):
            self.save()
        self._stop_if_preempted()

    def reports_after(self, step: int) -> bool:
        """Whether the metric row is reported once ``step`` steps are done."""
        return step % self.cfg.log_every == 0 or step == self.p.total_steps

    def _forward_and_update(self, batch: dict[str, Any], placeholder: bool,
                            ) -> tuple[Any, StepFlags]:
        """The step's forward, then its update unless a non-finite loss or a placeholder
        batch on any rank skips it on every rank."""
        p = self.p
        tau = self.controller.temperature if self.controller else p.objective_cfg.temperature
        reports = self.reports_after(self.step + 1)  # the effective rank: on these steps
        with autocast(self.precision, p.runtime.device):
            if self.cfg.chunk_size:
                out, backward = chunked_forward_loss(
                    p.engine, batch, p.objective, p.objective_cfg, tau, self.step,
                    self.cfg.chunk_size, p.batch_spec, measure_rank=reports)
            else:
                out = forward_loss(p.engine, batch, p.objective, p.objective_cfg, tau,
                                   self.step, p.batch_spec, measure_rank=reports)
                backward = functools.partial(p.engine.backward, out.loss)
        flags = agreed_flags(out.loss, placeholder)
        self.guard.record(flags.finite | ~flags.real)
        self.empty_steps = self.empty_steps + (~flags.real).long()
        if p.engine.skips_on_device:  # no host synchronisation: the update is masked
            backward()
            p.engine.step(skip=~flags.update)
        elif bool(flags.update):
            backward()
            p.engine.step()
        else:
            if not self.cfg.chunk_size:  # chunks ran no forward with gradient yet
                p.engine.skip(out.loss)
            if bool(flags.real):
                self.guard.check(self.step)  # synchronised anyway: stop at once
        return out, flags

    def _stop_if_preempted(self) -> None:
        """At the agreed step boundary: checkpoint (unless just written) and stop."""
        watch = self.p.preemption
        if watch is None or self.step >= self.p.total_steps or not watch.due(self.step) \
                or not watch.agreed():
            return
        if self.last_saved != self.step:
            self.save()
        path = self.p.checkpointer.checkpoints()[0]
        log.warning("preempted by %s: stopped at step %d with checkpoint %s", watch.received,
                    self.step, path)
        raise Preempted(self.step, watch.received or "a signal", str(path))

    def _monitor(self) -> None:
        result = self.p.monitor(self.p.engine.module.encoder)
        self.last_knn = {"step": self.step, **result}
        if self.p.runtime.is_main:
            log.info("step %d knn monitor: top-1 %.4f", self.step, result["knn_top1"])
            if self.p.tracker is not None:
                self.p.tracker.log_metrics(self.step, result)

    def _report(self, bar: tqdm, lr: float) -> None:
        """The window's metric row: the host synchronises here, once per log_every steps."""
        rt = self.p.runtime
        nonfinite_total = self.guard.check(self.step)
        elapsed = time.perf_counter() - self.window_start
        views = sum_over_ranks(self.views, rt.device)
        row = self.window.means_over_ranks()
        empty, self.empty_steps = int(self.empty_steps), 0
        if empty:
            log.warning("%d step(s) up to step %d had a rank whose every sample was skipped; "
                        "no update in them", empty, self.step)
        row.update(lr=lr, images_per_s=views / elapsed, memory_mib=peak_memory_mib(rt.device),
                   empty_steps=float(empty),
                   skipped_samples=sum_over_ranks(sum(self.loader_state.skipped.values()),
                                                  rt.device),
                   nonfinite_steps=float(nonfinite_total))
        if self.controller:
            row["temperature"] = float(self.controller.temperature)
        self.last_row = {"step": self.step, **row}
        warning = self.collapse.check(self.step, row)
        row["collapse"] = float(warning is not None)
        if rt.is_main:
            bar.set_postfix(loss=f"{row.get('loss', float('nan')):.4f}",
                            img_s=f"{row['images_per_s']:.0f}",
                            **({"collapse": "WARNING"} if warning else {}), refresh=False)
            if warning:
                log.warning(warning)
            if self.p.tracker is not None:
                self.p.tracker.log_metrics(self.step, row)
            log.info("step %d %s", self.step,
                     " ".join(f"{k}={v:.4g}" for k, v in sorted(row.items())))
        self.views = 0
        self.window_start = time.perf_counter()
        self.collapse.stop_if_spent()
