"""The training loop and its step, top to bottom (``docs/training.md``).

A :class:`Trainer` receives named parts, each built from its section of the run
configuration by :func:`app.pretrain.build_trainer`: the ``engine`` (the model and its
optimiser, DDP, DeepSpeed or FSDP2), the ``objective``, the ``loader``, the
``checkpointer``, the learning-rate ``schedule`` over the run's ``length``, the
``preemption`` watch and the ``reports`` (MLflow on rank 0, the epoch ledger, the FLOP
count, the kNN monitor); it builds its own ``monitors``. One step
(:meth:`Trainer.train_step`):

1. the learning rate from the schedule, a function of the samples consumed;
2. forward under autocast: this rank's embeddings (:func:`forward_loss`);
3. the gathering boundary: every rank's embeddings in one global batch
   (:func:`pretrain.distributed.build_global_batch`, the one place that talks to the
   process group);
4. the objective on that batch (the table's function, e.g. ``objectives/supcon.py``);
5. backward and the update through the engine, masked on the device when the loss is
   not finite on some rank (no host synchronisation);
6. the metrics, summed on the device and read every ``log_every`` steps.

``train.chunk_size`` runs steps 2-5 piece by piece with the cached embedding gradient
(``chunked.py``), as does a rank that holds more than one chunk of the global batch
(fewer ranks than chunks: ``pretrain/run/batch_cut.py``). The run is measured in samples of the data
set (:class:`RunLength`): it ends when the loader has delivered ``train.epochs`` epochs, or
after ``train.max_steps`` steps. Checkpoints follow :mod:`pretrain.run.checkpoint`.
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
from data_pipeline.loader import TrainLoader
from data_pipeline.samples import SKIP_REASONS
from pretrain.distributed import build_global_batch
from pretrain.distributed.engine_base import Engine
from pretrain.distributed.engine_state import add_engine_state, load_engine_state
from pretrain.loop.chunked import chunked_forward_loss
from pretrain.loop.collapse import (
    CollapseConfig,
    CollapseWatch,
    backbone_measures,
    effective_rank,
)
from pretrain.loop.device_metrics import (
    NonFiniteGuard,
    StepFlags,
    agreed_flags,
    kept_buffers,
)
from pretrain.loop.reports import Monitors, Reports
from pretrain.loop.run_length import RunLength
from pretrain.loop.step import Objective, model_inputs, to_device
from pretrain.model.encoder import ModelOutput
from pretrain.objectives import BatchRows, ObjectiveOutput
from pretrain.run.batch_cut import BatchCut
from pretrain.run.checkpoint import Checkpointer, Unresumable, rng_state, set_rng_state
from pretrain.run.config_drift import check_drift, unfit_checkpoint
from pretrain.run.hang import Hang, HangConfig, HangWatch, is_collective_timeout
from pretrain.run.preemption import Preempted, PreemptionWatch

log = logging.getLogger(__name__)


@dataclass
class TrainConfig:
    """``train.*``: length of the run and how it is watched."""

    epochs: int = 1  # passes over the training shards: the run ends when they are delivered
    max_steps: int = 0  # > 0: stop after this many steps (overrides epochs)
    log_every: int = 10  # steps between metric rows
    precision: Literal["auto", "fp32", "bf16", "fp64"] = "auto"  # auto: bf16 on GPU; fp64: exact
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto: cuda when available
    max_nonfinite: int = 5  # consecutive non-finite losses that stop the run
    chunk_size: int = 0  # > 0: encode in chunks of this many rows, cached gradient (GradCache)
    compile: bool = False  # torch.compile the encoder (docs/training.md, "Compiled step")
    progress: bool = True  # tqdm bar on rank 0
    knn_every: int = 0  # > 0: kNN monitor on a fixed subset of eval.* shards every N steps
    knn_samples: int = 2000  # size of that subset (bank and queries each)
    collapse: CollapseConfig = field(default_factory=CollapseConfig)  # collapse detection
    hang: HangConfig = field(default_factory=HangConfig)  # a rank that stopped: found, healed

    def validate(self) -> None:
        for key in ("epochs", "log_every", "max_nonfinite"):
            if getattr(self, key) < 1:
                raise InvalidValue(key, f"must be >= 1, got {getattr(self, key)}")
        for key in ("max_steps", "knn_every", "chunk_size"):
            if getattr(self, key) < 0:
                raise InvalidValue(key, f"must be >= 0, got {getattr(self, key)}")


def forward_loss(model: Callable[..., ModelOutput], batch: dict[str, Any],
                 objective: Objective, step: int, measure_rank: bool = True,
                 ) -> ObjectiveOutput:
    """Steps 2-4 of a training step: this rank's embeddings, the global batch, the
    objective (:func:`loss_of_outputs`)."""
    return loss_of_outputs(model(*model_inputs(batch)), batch, objective, step, measure_rank)


def loss_of_outputs(out: ModelOutput, batch: dict[str, Any], objective: Objective,
                    step: int, measure_rank: bool = True) -> ObjectiveOutput:
    """The objective on this rank's model outputs (``out.projections`` [2B, P], the ``text``
    [2B, P] of clip and siglip, a learnable ``temperature`` [] and the learnable
    ``loss_parameters``) against the global batch, with the collapse monitors among the
    metrics: the backbone's, and (``measure_rank``) the effective rank of this rank's
    embeddings, whose singular values make the host wait for a GPU, so the trainer asks
    for it on the steps that report, not on every step."""
    captions = batch.get("caption_embeddings")
    rows = BatchRows(out.projections, batch["ids"], batch.get("labels"),
                     None if captions is None else captions.to(out.projections.dtype),
                     out.text)
    global_batch = build_global_batch(rows, objective.options(step))
    temperature = objective.temperature if out.temperature is None else out.temperature
    with objective.declared(global_batch):  # checked, and in full precision
        result = objective.fn(global_batch, temperature, **out.loss_parameters)
    if measure_rank:
        result.metrics["effective_rank"] = effective_rank(out.projections.detach())
    if out.features is not None:
        result.metrics.update(backbone_measures(out.features, batch["ids"]))
    return result


def chunked_loss(engine: Engine, batch: dict[str, Any], objective: Objective, step: int,
                 chunk_size: int, measure_rank: bool = True,
                 pieces: tuple[int, int] | None = None,
                 ) -> tuple[ObjectiveOutput, Callable[[], None]]:
    """Steps 2-4 piece by piece (the batch's chunks, or ``train.chunk_size``), and the
    backward to run after them (``chunked.py``)."""
    loss_of = functools.partial(loss_of_outputs, batch=batch, objective=objective, step=step,
                                measure_rank=measure_rank)
    return chunked_forward_loss(engine, batch, loss_of, chunk_size, objective.rows_per_rank,
                                pieces)


class Trainer:
    """Trains ``engine.module`` for ``length``; see the module's docstring. ``schedule``:
    the learning-rate multiplier after a number of samples. ``loader`` None: the caller
    hands :meth:`train_step` its batches (tests, benchmarks)."""

    def __init__(self, cfg: TrainConfig, *, engine: Engine, objective: Objective,
                 loader: TrainLoader | None, checkpointer: Checkpointer,
                 schedule: Callable[[int], float], length: RunLength, runtime: Runtime,
                 precision: str, preemption: PreemptionWatch | None = None,
                 reports: Reports | None = None, cut: BatchCut | None = None,
                 hang: HangWatch | None = None) -> None:
        self.cfg, self.runtime, self.precision = cfg, runtime, precision
        # the pieces a step encodes in, from the run's cut of its global batch (None: the
        # batch is one chunk)
        self.pieces = cut.pieces(cfg.chunk_size) if cut and cfg.chunk_size else None
        self.engine, self.objective, self.loader = engine, objective, loader
        self.checkpointer, self.preemption, self.hang = checkpointer, preemption, hang
        self.schedule, self.length = schedule, length
        self.reports = reports or Reports()
        self.total_steps = length.max_steps or -(-length.total_samples
                                                 // length.samples_per_step)
        self.monitors = Monitors(NonFiniteGuard(cfg.max_nonfinite, runtime.device),
                                 CollapseWatch(cfg.collapse), self.reports.knn)
        self.step = self.samples = 0  # steps done, samples of the data set consumed
        self.last_saved = -1
        self.last_row: dict[str, float] = {}  # the newest logged metrics (all ranks' mean)
        self.last_knn: dict[str, float] = {}  # the newest kNN monitor result
        self.views, self.window_start = 0, time.perf_counter()
        self.empty_steps: torch.Tensor | int = 0  # steps with a placeholder batch, unreported
        self.bar = tqdm(disable=True)

    @property
    def model(self) -> torch.nn.Module:
        return self.engine.module

    # -- the loop ---------------------------------------------------------------------
    def train(self) -> None:
        """Train from where :meth:`resume` left the run to its end."""
        if self.loader is not None and not self.length.max_steps:  # the loader's epochs
            self.total_steps = self.step + self.loader.steps_left(self.length.epochs)
        if self.runtime.is_main:
            log.info("%d steps to go of %d samples each, from epoch %.2f", self.total_steps
                     - self.step, self.length.samples_per_step, self.length.epoch(self.samples))
        self.bar = tqdm(total=self.total_steps, initial=self.step, unit="step",
                        disable=not (self.cfg.progress and self.runtime.is_main),
                        dynamic_ncols=True)
        self.window_start = time.perf_counter()
        if self.reports.ledger is not None:
            self.reports.ledger.start(self.step)
        try:
            self.run_steps()
            with self.long_phase("end"):
                if self.last_saved != self.step:
                    self.save()
                self.finish_checkpoint()
        finally:
            if self.reports.ledger is not None:
                self.reports.ledger.close()
            if self.hang is not None:
                self.hang.close()
        self.report_skips()

    def run_steps(self) -> None:
        """Steps to ``total_steps``, epoch after epoch."""
        hang = self.hang
        try:
            with self.preemption or contextlib.nullcontext():
                while self.step < self.total_steps:
                    for batch in self.loader.epoch():
                        if hang is not None:
                            hang.batch_arrived()
                        self.train_step(batch)
                        if hang is not None:
                            hang.progress(self.step)
                        if self.step >= self.total_steps:
                            break
        except RuntimeError as err:  # a peer stopped: name it, then end as a crash does
            if hang is not None and is_collective_timeout(err):
                raise Hang(hang.timed_out(self.step + 1)) from None
            raise
        finally:
            self.loader.close()
            self.bar.close()

    def train_step(self, batch: dict[str, Any]) -> None:
        placeholder = bool(batch.get("placeholder", False))  # the loader's, on the host
        batch = to_device(batch, self.runtime.device)
        lr = self.engine.set_lr(self.schedule(self.samples))  # 1
        reports = self.reports_after(self.step + 1)
        with kept_buffers(self.model, placeholder):  # a placeholder leaves no statistics
            with autocast(self.precision, self.runtime.device):
                if self.cfg.chunk_size:  # 2-4 chunk by chunk, 5 returned for later
                    out, backward = chunked_loss(self.engine, batch, self.objective,
                                                 self.step, self.cfg.chunk_size, reports,
                                                 self.pieces)
                else:  # 2-4, as forward_loss
                    out = loss_of_outputs(self.engine(*model_inputs(batch)), batch,
                                          self.objective, self.step, reports)
                    backward = functools.partial(self.engine.backward, out.loss)
            flags = self.update(out, backward, placeholder)  # 5
        if self.objective.controller:
            self.objective.controller.update(mean_over_ranks_on_device(out.metrics["ess"]),
                                             self.samples / self.length.total_samples)
        self.step += 1
        self.samples += self.length.samples_per_step
        if self.reports.ledger is not None:
            self.reports.ledger.record(self.loader.state.epoch, self.step, batch, flags.update)
        self.monitors.window.add(out.metrics, flags.real)  # 6
        self.views += 0 if placeholder else len(batch["images"])
        self.bar.update(1)
        if reports:
            self.report(lr)
        if self.monitors.knn is not None and self.step % self.cfg.knn_every == 0:
            self.run_knn_monitor()
        if self.checkpointer.due(self.step):
            self.save()
        self.stop_if_preempted()

    def reports_after(self, step: int) -> bool:
        """Whether the metric row is reported once ``step`` steps are done."""
        return step % self.cfg.log_every == 0 or step == self.total_steps

    def update(self, out: ObjectiveOutput, backward: Callable[[], None],
               placeholder: bool) -> StepFlags:
        """Backward and the optimiser step, unless a non-finite loss or a placeholder
        batch on any rank skips it on every rank: masked on the device where the engine
        can (DDP), decided on the host where it cannot (DeepSpeed)."""
        flags = agreed_flags(out.loss, placeholder)
        guard = self.monitors.guard
        guard.record(flags.finite | ~flags.real)
        self.empty_steps = self.empty_steps + (~flags.real).long()
        if self.engine.skips_on_device:
            backward()
            self.engine.step(skip=~flags.update)
        elif bool(flags.update):
            backward()
            self.engine.step()
        else:
            if not self.cfg.chunk_size:  # chunks ran no forward with gradient yet
                self.engine.skip(out.loss)
            if bool(flags.real):
                guard.check(self.step)  # synchronised anyway: stop at once
        return flags

    # -- reports and monitors ---------------------------------------------------------
    def report(self, lr: float) -> None:
        """The window's metric row: the host synchronises here, once per log_every steps."""
        device = self.runtime.device
        nonfinite_total = self.monitors.guard.check(self.step)
        elapsed = time.perf_counter() - self.window_start
        views = sum_over_ranks(self.views, device)
        row = self.monitors.window.means_over_ranks()
        empty, self.empty_steps = int(self.empty_steps), 0
        if empty:
            log.warning("%d step(s) up to step %d had a rank whose every sample was skipped; "
                        "no update in them", empty, self.step)
        skipped = sum(self.loader.state.skipped.values()) if self.loader else 0
        row.update(lr=lr, images_per_s=views / elapsed, memory_mib=peak_memory_mib(device),
                   epoch=self.length.epoch(self.samples), samples=float(self.samples),
                   global_batch=float(self.length.samples_per_step),
                   empty_steps=float(empty), skipped_samples=sum_over_ranks(skipped, device),
                   nonfinite_steps=float(nonfinite_total))
        if self.objective.controller:
            row["temperature"] = float(self.objective.controller.temperature)
        if self.reports.utilisation is not None:
            row.update(self.reports.utilisation.metrics(row["images_per_s"]))
        self.last_row = {"step": self.step, **row}
        warning = self.monitors.collapse.check(self.step, row)
        row["collapse"] = float(warning is not None)
        if self.runtime.is_main:
            self.bar.set_postfix(epoch=f"{row['epoch']:.2f}/{self.length.epochs}",
                                 loss=f"{row.get('loss', float('nan')):.4f}",
                                 img_s=f"{row['images_per_s']:.0f}",
                                 **({"collapse": "WARNING"} if warning else {}), refresh=False)
            if warning:
                log.warning(warning)
            if self.reports.tracker is not None:
                self.reports.tracker.log_metrics(self.step, row)
            log.info("step %d %s", self.step,
                     " ".join(f"{k}={v:.4g}" for k, v in sorted(row.items())))
        self.views = 0
        self.window_start = time.perf_counter()
        if self.reports.ledger is not None:  # the host has synchronised: the flags are in
            self.reports.ledger.flush()
        self.monitors.collapse.stop_if_spent()

    def long_phase(self, name: str) -> contextlib.AbstractContextManager:
        """A phase that may outlast a step many times (a checkpoint, the kNN monitor): the
        hang watch follows its own time while it lasts."""
        return (self.hang.long_phase(name) if self.hang is not None
                else contextlib.nullcontext())

    def run_knn_monitor(self) -> None:
        with self.engine.whole_root(), self.long_phase("knn"):
            result = self.monitors.knn(self.model.encoder)
        self.last_knn = {"step": self.step, **result}
        if self.runtime.is_main:
            log.info("step %d knn monitor: top-1 %.4f", self.step, result["knn_top1"])
            if self.reports.tracker is not None:
                self.reports.tracker.log_metrics(self.step, result)

    def report_skips(self) -> None:
        """The run's skipped samples: each rank logs its own (per reason and shard, with
        examples); rank 0 sends the totals per reason to MLflow."""
        state = self.loader.state
        summary = state.summary()
        if summary:
            log.warning("rank %d data: %s", self.runtime.rank, summary)
        totals = totals_over_ranks({f"skipped.{reason}": state.skipped.get(reason, 0)
                                    for reason in SKIP_REASONS}, self.runtime.device)
        if self.runtime.is_main:
            log.info("data: skipped per reason over all ranks: %s",
                     {k.split(".")[1]: int(v) for k, v in totals.items() if v} or "none")
            if self.reports.tracker is not None:
                self.reports.tracker.log_metrics(self.step, totals)

    def stop_if_preempted(self) -> None:
        """At the agreed step boundary: checkpoint (unless just written) and stop."""
        watch = self.preemption
        if watch is None or self.step >= self.total_steps or not watch.due(self.step) \
                or not watch.agreed():
            return
        with self.long_phase("preempt"):
            if self.last_saved != self.step:
                self.save()
            self.finish_checkpoint()
        path = self.checkpointer.checkpoints()[0]
        log.warning("preempted by %s: stopped at step %d with checkpoint %s", watch.received,
                    self.step, path)
        raise Preempted(self.step, watch.received or "a signal", str(path))

    # -- checkpoints ------------------------------------------------------------------
    def save(self) -> Path:
        """A checkpoint of this step: what every rank shares (written once, by rank 0) and
        what is this rank's own (its RNG streams, its loader position, and its optimiser
        partition under ZeRO)."""
        with self.long_phase("save"):
            return self._save()

    def _save(self) -> Path:
        controller = self.objective.controller
        replicated = {"step": self.step, "samples": self.samples, "world": self.runtime.world,
                      "global_batch": self.checkpointer.global_batch,
                      "nonfinite_total": self.monitors.guard.check(self.step),
                      "config": self.checkpointer.config_yaml,
                      "controller": controller.state_dict() if controller else {},
                      "collapse": self.monitors.collapse.state_dict()}
        per_rank = {"rng": rng_state(),
                    "loader": self.loader.state_dict() if self.loader else {}}
        write_state = add_engine_state(self.engine, self.checkpointer.cfg, replicated,
                                       per_rank)
        if self.reports.ledger is not None:  # the lines of this checkpoint's steps, on disk first
            self.reports.ledger.flush()
        path = self.checkpointer.save(self.step, replicated, per_rank, write_state)
        self.note_commit()
        self.last_saved = self.step
        log.info("checkpoint: %s%s", path, " (its state being written in the background)"
                 if self.checkpointer.pending else "")
        return path

    def finish_checkpoint(self) -> None:
        """Wait for a checkpoint being written in the background (``checkpoint.async_save``)
        and complete it."""
        self.checkpointer.finish()
        self.note_commit()

    def note_commit(self) -> None:
        """The newest complete checkpoint into the ledger."""
        if self.reports.ledger is not None and self.checkpointer.completed >= 0:
            self.reports.ledger.commit(self.checkpointer.completed)

    def resume(self) -> bool:
        """Continue from the newest readable checkpoint, if there is one."""
        loaded = self.checkpointer.load()
        if loaded is None:
            return False
        replicated, per_rank, path = loaded
        config = self.checkpointer.config_yaml
        check_drift(path, replicated.get("config", ""), config,
                    self.checkpointer.cfg.allow_changes)
        try:
            load_engine_state(self.engine, replicated, per_rank, path)
        except Unresumable as err:  # a layout this engine does not read
            raise Unresumable(f"{path}: {err} (the checkpoint is kept)") from None
        except RuntimeError as err:  # tensors of another model: name what changed
            raise unfit_checkpoint(path, replicated.get("config", ""), config, err) from None
        self.step = self.last_saved = replicated["step"]
        self.samples = replicated.get("samples", self.step * self.length.samples_per_step)
        self.monitors.guard.total = replicated["nonfinite_total"]
        if self.objective.controller:
            self.objective.controller.load_state_dict(replicated["controller"])
        self.monitors.collapse.load_state_dict(replicated.get("collapse", {}))
        self.loader.load_state_dict(per_rank["loader"])
        set_rng_state(per_rank["rng"])
        log.info("resumed from %s at step %d", path, self.step)
        return True
