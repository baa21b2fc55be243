"""Checkpoints: atomic, every N steps and at the end, the last K kept, resumable.

Layout under ``<run_dir>/checkpoints/``::

    step_00000100/shared.pt     rank 0: model, optimizer (unless sharded), step,
                                temperature controller, non-finite count, resolved config
    step_00000100/rank_000.pt   each rank: RNG states, loader state, sharded optimizer state

A checkpoint is written into ``.step_00000100.tmp/`` and renamed into place by rank 0
once every rank has written (rename is atomic), so a crash mid-write never leaves a
checkpoint that looks complete. Every file holds only tensors, numbers, strings, lists,
tuples and dicts: ``torch.load(..., weights_only=True)`` reads it. ``resume="auto"`` takes
the newest checkpoint that every rank can read; an unreadable one (truncated, corrupt) is
reported and the previous one tried.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from core.collectives import all_ranks_agree, barrier
from core.config import InvalidValue

log = logging.getLogger(__name__)


@dataclass
class CheckpointConfig:
    """``checkpoint.*``."""

    every: int = 50  # steps between checkpoints; 0: only at the end
    keep: int = 3  # newest checkpoints kept
    resume: str = "auto"  # auto (newest readable in the run dir), never, or a checkpoint dir

    def validate(self) -> None:
        if self.every < 0:
            raise InvalidValue("every", f"must be >= 0, got {self.every}")
        if self.keep < 1:
            raise InvalidValue("keep", f"must be >= 1, got {self.keep}")
        if self.resume not in ("auto", "never") and not Path(self.resume).is_dir():
            raise InvalidValue("resume", f"{self.resume}: not auto, never or a checkpoint dir")


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


def list_checkpoints(run_dir: Path) -> list[Path]:
    """The complete checkpoints of a run directory, newest first."""
    root = run_dir / "checkpoints"
    return sorted(root.glob("step_*"), reverse=True) if root.is_dir() else []


def _save(obj: Any, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


class Checkpointer:
    def __init__(self, run_dir: Path, cfg: CheckpointConfig, rank: int, world: int,
                 device: torch.device) -> None:
        self.run_dir, self.root = run_dir, run_dir / "checkpoints"
        self.cfg, self.rank, self.world, self.device = cfg, rank, world, device

    def due(self, step: int) -> bool:
        return self.cfg.every > 0 and step % self.cfg.every == 0

    def checkpoints(self) -> list[Path]:
        """Complete checkpoints, newest first."""
        return list_checkpoints(self.run_dir)

    def save(self, step: int, shared: dict[str, Any], own: dict[str, Any]) -> Path:
        """Write this step's checkpoint (a collective: every rank calls it)."""
        final = self.root / f"step_{step:08d}"
        tmp = self.root / f".step_{step:08d}.tmp"
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        barrier()
        _save(own, tmp / f"rank_{self.rank:03d}.pt")
        if self.rank == 0:
            _save(shared, tmp / "shared.pt")
        barrier()
        if self.rank == 0:
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            for old in self.checkpoints()[self.cfg.keep:]:
                shutil.rmtree(old, ignore_errors=True)
        barrier()
        return final

    def _read(self, path: Path) -> tuple[dict[str, Any], dict[str, Any]] | str:
        own_file = path / f"rank_{self.rank:03d}.pt"
        if not own_file.is_file():
            return f"{own_file} is missing (was it written by {self.world} ranks?)"
        try:
            shared = torch.load(path / "shared.pt", map_location="cpu", weights_only=True)
            own = torch.load(own_file, map_location="cpu", weights_only=True)
        except Exception as err:  # truncated, corrupt or foreign: report and fall back
            return f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
        if shared.get("world") != self.world:
            return f"written by {shared.get('world')} ranks, this run has {self.world}"
        return shared, own

    def load(self) -> tuple[dict[str, Any], dict[str, Any], Path] | None:
        """The newest checkpoint every rank can read, per ``resume``; None: start fresh."""
        if self.cfg.resume == "never":
            return None
        candidates = ([Path(self.cfg.resume)] if self.cfg.resume != "auto"
                      else self.checkpoints())
        for path in candidates:
            result = self._read(path)
            if all_ranks_agree(not isinstance(result, str), self.device):
                return (*result, path)
            reason = result if isinstance(result, str) else "unreadable on another rank"
            log.warning("checkpoint %s is unreadable (%s); trying the previous one", path,
                        reason)
        if self.cfg.resume != "auto":
            raise FileNotFoundError(f"checkpoint.resume={self.cfg.resume}: not readable")
        return None
