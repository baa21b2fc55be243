"""Helpers to run the real ``pretrain`` command on the session's digits shards."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil

from tests import prewarmed

REPO = Path(__file__).resolve().parents[2]


def train_overrides(shards: Path, out: Path, **extra: object) -> list[str]:
    """A fast CPU run: small CNN at 16 px, 16 images per rank, no MLflow."""
    base = {"output_dir": out, "name": "run", "data.shards": shards, "data.batch_size": 16,
            "data.resolution": 16, "data.workers": 2, "model.projector_hidden": 64,
            "model.projector_dim": 32, "objective.name": "infonce", "optim.warmup_steps": 2,
            "train.log_every": 2, "train.progress": False, "tracking.enabled": False}
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def uses_torchrun(nproc: int, torchrun: bool | None) -> bool:
    """Whether the run starts under torchrun: by default when there is more than one process
    (DeepSpeed needs torchrun's environment even for one, so a caller may ask for it)."""
    return nproc > 1 if torchrun is None else torchrun


def pretrain_command(overrides: list[str], nproc: int = 1,
                     torchrun: bool | None = None) -> list[str]:
    """``app.pretrain``'s command line, under torchrun when ``uses_torchrun``."""
    if not uses_torchrun(nproc, torchrun):
        return [sys.executable, "-m", "app.pretrain", *overrides]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
            "--standalone", "-m", "app.pretrain", *overrides]


def run_pretrain(overrides: list[str], nproc: int = 1, timeout: float = 300,
                 torchrun: bool | None = None) -> subprocess.CompletedProcess:
    """The command's result, its process (or torchrun's agent and each rank) forked from a
    pre-imported interpreter (``tests/prewarmed.py``: what that still proves)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    if uses_torchrun(nproc, torchrun):
        return prewarmed.run_torchrun("app.pretrain", overrides, nproc, env, timeout)
    return prewarmed.run_module("app.pretrain", overrides, env, timeout)


def sigkill(processes: list[psutil.Process]) -> None:
    """SIGKILL each of ``processes``; one that ended after it was listed (a ``curl`` that
    finished its read, a worker its parent's death took) is passed over."""
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.send_signal(signal.SIGKILL)
