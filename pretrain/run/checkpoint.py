"""Checkpoints: atomic, every N steps and at the end, the last K kept, resumable.

Layout under ``<run_dir>/checkpoints/``::

    step_00000100/shared.pt     rank 0: model, optimizer (unless sharded), step,
                                temperature controller, non-finite count, resolved config
    step_00000100/rank_000.pt   each rank: RNG states, loader state, sharded optimizer state
    step_00000100/state/        checkpoint.format=sharded: the model and optimizer state,
                                written by every rank (``sharded.py``), not in shared.pt

A checkpoint is written into ``.step_00000100.tmp/`` and renamed into place by rank 0
once every rank has written (rename is atomic), so a crash mid-write never leaves a
checkpoint that looks complete. Every file holds only tensors, numbers, strings, lists,
tuples and dicts: ``torch.load(..., weights_only=True)`` reads it. ``resume="auto"`` takes
the newest checkpoint that every rank can read; an unreadable one (truncated, corrupt) is
reported, renamed to ``step_..._unreadable`` (kept, and never overwritten by the steps
trained again) and the previous one tried.

A checkpoint written by another number of ranks resumes: each new rank gets its loader
position (:func:`pretrain.run.reshard.loader_state_for`, where the semantics are defined),
RNG streams seeded from (step, rank), and with sharded optimizer state (DeepSpeed ZeRO)
every old rank's partition, from which the engine cuts its own, or which a run under DDP
or FSDP2 joins into per-parameter state (``reshard.per_parameter_state``). A checkpoint
with replicated optimizer state is refused by a ZeRO run with a message and kept. A run
never starts from scratch over checkpoints it could not resume.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, NamedTuple

import numpy as np
import torch
from torch.distributed.checkpoint.api import CheckpointException

from core.collectives import all_ranks_agree, barrier
from core.config import InvalidValue
from core.errors import RunError, disk_full, error_chain, first_line, no_space
from data_pipeline.samples import stable_int
from pretrain.run.reshard import batches_done, loader_state_for
from pretrain.run.sharded import FORMAT, STATE_DIR, model_state

log = logging.getLogger(__name__)


@dataclass
class CheckpointConfig:
    """``checkpoint.*``."""

    every: int = 50  # steps between checkpoints; 0: only at the end
    keep: int = 3  # newest checkpoints kept
    resume: str = "auto"  # auto (newest readable in the run dir), never, or a checkpoint dir
    allow_changes: list[str] = field(default_factory=list)  # trained keys a resume may change
    format: Literal["full", "sharded"] = "full"  # full: in shared.pt; sharded: DCP, per rank
    # full gathers the model and optimizer state on rank 0; sharded: each rank writes its
    # shards with torch.distributed.checkpoint into state/ (engine ddp or fsdp2)
    # the checkpoint counts (is renamed into place) once every rank's write has finished,
    # checked at the next save and at the end of the run
    async_save: bool = False  # sharded only: written in the background while training goes on

    def validate(self) -> None:
        if self.every < 0:
            raise InvalidValue("every", f"must be >= 0, got {self.every}")
        if self.keep < 1:
            raise InvalidValue("keep", f"must be >= 1, got {self.keep}")
        if self.resume not in ("auto", "never") and not Path(self.resume).is_dir():
            raise InvalidValue("resume", f"{self.resume}: not auto, never or a checkpoint dir")
        if self.async_save and self.format != "sharded":
            raise InvalidValue("async_save", "needs checkpoint.format=sharded (a full "
                                             "checkpoint is gathered and written by rank 0)")


def rng_state() -> dict[str, Any]:
    """Every RNG the run draws from, as weights_only-loadable values."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss)}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def seeded_rng_state(seed: int) -> dict[str, Any]:
    """:func:`rng_state` as it is after seeding every generator with ``seed``; the
    generators themselves are left as they were."""
    saved = rng_state()
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)
    state = rng_state()
    set_rng_state(saved)
    return state


def list_checkpoints(run_dir: Path) -> list[Path]:
    """The complete checkpoints of a run directory, newest first."""
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return []
    return sorted((p for p in root.glob("step_*") if p.name[5:].isdigit()), reverse=True)


def _save(obj: Any, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def interrupt_within(err: BaseException) -> KeyboardInterrupt | None:
    """The Ctrl-C behind ``err``, if any. A SIGINT that lands while torch.save's writer
    calls back into Python ends in a ``RuntimeError`` ("unexpected pos") raised while the
    ``KeyboardInterrupt`` is handled; it is found in the error chain."""
    return next((e for e in error_chain(err) if isinstance(e, KeyboardInterrupt)), None)


class PendingSave(NamedTuple):
    """A checkpoint whose sharded state a background thread is writing into ``tmp``."""

    tmp: Path
    final: Path
    writing: Future


class Checkpointer:
    """Saves and finds the checkpoints of one run for ``rank`` of ``world`` ranks training
    at ``global_batch`` images per step (0: as the checkpoint was written), with sharded
    (ZeRO) or replicated optimizer state; ``config_yaml``, the run's resolved
    configuration, goes into every checkpoint and is compared at resume."""

    def __init__(self, run_dir: Path, cfg: CheckpointConfig, rank: int, world: int,
                 device: torch.device, global_batch: int = 0, sharded: bool = False,
                 config_yaml: str = "") -> None:
        self.run_dir, self.root = run_dir, run_dir / "checkpoints"
        self.cfg, self.rank, self.world, self.device = cfg, rank, world, device
        self.global_batch, self.sharded = global_batch, sharded
        self.config_yaml = config_yaml
        self.pending: PendingSave | None = None  # a checkpoint whose state is being written
        self.completed = -1  # the step of the newest checkpoint this process completed

    def due(self, step: int) -> bool:
        return self.cfg.every > 0 and step % self.cfg.every == 0

    def checkpoints(self) -> list[Path]:
        """Complete checkpoints, newest first."""
        return list_checkpoints(self.run_dir)

    def save(self, step: int, shared: dict[str, Any], own: dict[str, Any],
             write_state: Callable[[Path], Future | None] | None = None) -> Path:
        """Write this step's checkpoint (a collective: every rank calls it), with
        ``write_state(directory)`` writing the sharded state (every rank). When any rank
        cannot write its part (a full disk, a lost mount), every rank raises
        :class:`RunError` and the partial checkpoint is removed; the complete ones are
        kept. A ``write_state`` that returns a future (``checkpoint.async_save``) leaves the
        checkpoint pending: :meth:`finish` completes it, as the next save does first."""
        self.finish()
        final = self.root / f"step_{step:08d}"
        tmp = self.root / f".step_{step:08d}.tmp"
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        barrier()
        writing: list[Future] = []
        failure = self._write(lambda: self._files(tmp, shared, own, write_state, writing))
        # in the background on every rank (checkpoint.async_save) only if every rank's
        # files are written so far; else every rank goes on to remove it and raise
        if writing and all_ranks_agree(failure is None, self.device):
            self.pending = PendingSave(tmp, final, writing[0])
            return final
        self._complete(tmp, final, failure)
        return final

    def finish(self) -> None:
        """Wait for the pending background write, if any, and complete its checkpoint (a
        collective: every rank calls it)."""
        if self.pending is None:
            return
        tmp, final, writing = self.pending
        self.pending = None
        self._complete(tmp, final, self._write(writing.result))

    def _complete(self, tmp: Path, final: Path, failure: BaseException | None) -> None:
        """Every rank's files written: the checkpoint renamed into place and the oldest
        pruned; else removed, and every rank raises."""
        if not all_ranks_agree(failure is None, self.device):
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise self._unwritten(tmp, failure)
        if self.rank == 0:
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            for old in self.checkpoints()[self.cfg.keep:]:
                shutil.rmtree(old, ignore_errors=True)
        barrier()
        self.completed = int(final.name.removeprefix("step_"))

    def _files(self, tmp: Path, shared: dict[str, Any], own: dict[str, Any],
               write_state: Callable[[Path], Future | None] | None,
               writing: list[Future]) -> None:
        """This rank's files of a checkpoint; a background write's future into
        ``writing``."""
        tmp.mkdir(parents=True, exist_ok=True)
        if write_state is not None:  # DCP: every rank, before any can fail alone
            future = write_state(tmp / STATE_DIR)
            writing.extend([future] if future is not None else [])
        _save(own, tmp / f"rank_{self.rank:03d}.pt")
        if self.rank == 0:
            _save(shared, tmp / "shared.pt")

    @staticmethod
    def _write(write: Callable[[], Any]) -> BaseException | None:
        """Run ``write``; the error that stopped it, if any."""
        try:
            write()
        except (OSError, RuntimeError, CheckpointException) as err:  # torch.save and DCP
            # wrap the OSError; DCP raises on every rank when any rank's write failed
            interrupt = interrupt_within(err)
            if interrupt is not None:  # Ctrl-C mid-write: a stop, not a failed disk
                raise interrupt from None
            return err
        return None

    def _unwritten(self, tmp: Path, failure: Exception | None) -> RunError:
        kept = ("the partial checkpoint was removed, every complete one is kept and the same "
                "command resumes from the newest")
        if failure is None:
            return RunError(f"another rank could not write its part of checkpoint {tmp} (its "
                            f"log line names why); {kept}")
        if disk_full(failure):
            return no_space("checkpoint", tmp, "output_dir", kept)
        return RunError(f"could not write checkpoint {tmp} ({type(failure).__name__}: "
                        f"{first_line(failure)}); {kept}")

    def _read(self, path: Path) -> tuple[dict[str, Any], dict[str, Any]] | str:
        try:
            shared = torch.load(path / "shared.pt", map_location="cpu", weights_only=True)
            dcp_state = shared.get("state") == FORMAT
            if dcp_state and self.sharded:
                raise Unresumable(f"{path} holds a sharded (DCP) state, which DeepSpeed ZeRO "
                                  "does not read: resume it with engine.name=ddp or fsdp2 "
                                  "(the checkpoint is kept)")
            zero_state = not dcp_state and "optimizer" not in shared
            if self.sharded and not zero_state and not dcp_state:
                raise Unresumable(f"{path} holds replicated optimizer state (DDP) and this "
                                  "run has sharded optimizer state (DeepSpeed ZeRO): resume "
                                  "it with the engine that wrote it (the checkpoint is kept)")
            old_global = int(shared.get("global_batch", 0))
            new_global = self.global_batch or old_global
            if shared.get("world") == self.world and (self.sharded or not zero_state):
                own = torch.load(path / f"rank_{self.rank:03d}.pt", map_location="cpu",
                                 weights_only=True)
                if old_global and new_global != old_global and not own["loader"].get("layout"):
                    loader = own["loader"]
                    loader["batches"] = batches_done(loader["batches"], old_global, new_global)
            else:
                olds = [torch.load(path / f"rank_{r:03d}.pt", map_location="cpu",
                                   weights_only=True) for r in range(int(shared["world"]))]
                if not old_global:
                    raise Unresumable(f"{path} does not record its global batch (written by "
                                      "an older version): resume it on "
                                      f"{shared.get('world')} ranks")
                loaders = [old["loader"] for old in olds]
                own = {"loader": loader_state_for(loaders, self.rank, old_global, new_global),
                       "rng": seeded_rng_state(stable_int("resume", shared["step"], self.rank))}
                if zero_state:  # every partition: to cut this rank's, or to join them
                    own["optimizer_partitions"] = [old["optimizer"] for old in olds]
                log.info("%s: written by %s ranks%s, resumed on %d", path, shared["world"],
                         "" if self.sharded or not zero_state else " under DeepSpeed ZeRO",
                         self.world)
        except Unresumable:
            raise
        except Exception as err:  # truncated, corrupt or foreign: report and fall back
            return f"{type(err).__name__}: {first_line(err)}"
        return shared, own

    def load(self) -> tuple[dict[str, Any], dict[str, Any], Path] | None:
        """The newest checkpoint every rank can read, per ``resume``; None: start fresh.
        Raises :class:`Unresumable` rather than start over checkpoints it cannot use."""
        existing = self.checkpoints()
        if self.cfg.resume == "never":
            if existing:
                raise Unresumable(f"{self.root} holds checkpoints and checkpoint.resume=never "
                                  "would overwrite them: choose another name or output_dir")
            return None
        candidates = [Path(self.cfg.resume)] if self.cfg.resume != "auto" else existing
        for path in candidates:
            result = self._read(path)
            if all_ranks_agree(not isinstance(result, str), self.device):
                return (*result, path)
            reason = result if isinstance(result, str) else "unreadable on another rank"
            log.warning("checkpoint %s is unreadable (%s)%s; trying the previous one", path,
                        reason, f"; kept as {path.name}_unreadable"
                        if self.cfg.resume == "auto" else "")
            barrier()
            if self.rank == 0 and self.cfg.resume == "auto":
                os.replace(path, path.with_name(path.name + "_unreadable"))
            barrier()
        if candidates:
            where = self.root if self.cfg.resume == "auto" else self.cfg.resume
            raise Unresumable(f"no checkpoint of {where} could be read (see the warnings "
                              "above; unreadable ones are kept as step_..._unreadable): set "
                              "checkpoint.resume to one, or start another run name")
        return None


def model_state_of(checkpoint: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """A checkpoint directory's ``shared.pt`` and its model state, whole, read in this
    process: from ``shared.pt``, or from the sharded state of ``checkpoint.format=sharded``."""
    shared = torch.load(checkpoint / "shared.pt", map_location="cpu", weights_only=True)
    if shared.get("state") == FORMAT:
        return shared, model_state(checkpoint / STATE_DIR)
    return shared, shared["model"]


class Unresumable(RunError):
    """Checkpoints exist that this run cannot resume: stop rather than overwrite them."""
