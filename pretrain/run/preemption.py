"""Preemption: a signal asks the run to stop; every rank stops at the same step boundary,
the run writes a checkpoint, and the process exits with :data:`PREEMPTED_EXIT_STATUS`.

Shared clusters stop jobs with SIGTERM (slurm at the time limit or on preemption,
Kubernetes on eviction, torchrun's agent forwarding what it received) and can send an
earlier warning (slurm's ``--signal=USR1@180``). The handler only records the signal. Every
``preemption.check_every`` steps the ranks agree with one all-reduce (MAX) of a flag on the
device, so a rank that received nothing stops with the others and no step synchronises the
host on its own account. A second SIGTERM while the checkpoint is written ends the process
at once (the default action).
"""

from __future__ import annotations

import logging
import signal
import threading
from dataclasses import dataclass
from types import FrameType

import torch
import torch.distributed as dist

from core.collectives import active
from core.config import InvalidValue

log = logging.getLogger(__name__)

# What a shell reports for a process ended by SIGTERM (128 + 15): slurm and Kubernetes read
# it as "terminated", not as a failure of the program
PREEMPTED_EXIT_STATUS = 143
MARKER = "preempted"  # <run_dir>/preempted: what stopped the run (launch/slurm.sbatch requeues)


@dataclass
class PreemptionConfig:
    """``preemption.*``: the signals that stop a run with a checkpoint."""

    warning_signal: str = "SIGUSR1"  # besides SIGTERM; "" = SIGTERM only
    check_every: int = 10  # steps between the ranks' agreement on a stop (one all-reduce)

    def validate(self) -> None:
        if self.check_every < 1:
            raise InvalidValue("check_every", f"must be >= 1, got {self.check_every}")
        if self.warning_signal and not isinstance(getattr(signal, self.warning_signal, None),
                                                  signal.Signals):
            raise InvalidValue("warning_signal", f"{self.warning_signal!r} is not a signal "
                               "name (e.g. SIGUSR1)")

    @property
    def signals(self) -> list[signal.Signals]:
        names = ["SIGTERM", *([self.warning_signal] if self.warning_signal else [])]
        return [getattr(signal, name) for name in dict.fromkeys(names)]


class Preempted(Exception):  # noqa: N818 (a stop, not an error)
    """The run stopped for a signal after writing its checkpoint at ``step``."""

    def __init__(self, step: int, signal_name: str, checkpoint: str) -> None:
        super().__init__(f"preempted by {signal_name} at step {step}; checkpoint {checkpoint}")
        self.step, self.signal_name, self.checkpoint = step, signal_name, checkpoint


class PreemptionWatch:
    """Records the configured signals while installed (a context manager, main thread)."""

    def __init__(self, cfg: PreemptionConfig, device: torch.device) -> None:
        self.cfg, self.device = cfg, device
        self.received: str | None = None
        self._previous: dict[signal.Signals, object] = {}

    def __enter__(self) -> PreemptionWatch:
        if threading.current_thread() is threading.main_thread():
            for sig in self.cfg.signals:
                self._previous[sig] = signal.signal(sig, self._record)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _record(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.received is not None and signum == signal.SIGTERM:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # asked twice: stop now
            signal.raise_signal(signal.SIGTERM)
        self.received = self.received or name

    def due(self, step: int) -> bool:
        return step % self.cfg.check_every == 0

    def agreed(self) -> bool:
        """True when any rank received a signal (a collective: every rank calls it at the
        same step)."""
        flag = torch.tensor([1.0 if self.received else 0.0], device=self.device)
        if active():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        stop = bool(flag.item() > 0)
        if stop and self.received is None:
            self.received = "a signal on another rank"
        return stop
