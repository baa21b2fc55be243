"""Step bookkeeping that stays on the device: the metric window and the non-finite guard.

A step adds its metrics and its finite flag as tensor operations; nothing turns into a
Python number until the window is reported, once per ``train.log_every`` steps, with one
all-reduce and one transfer for all metrics. On a GPU this keeps the host from waiting on
the device every step (``docs/training.md``, "Host synchronisation").
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import Tensor

from core.collectives import active
from core.errors import RunError

log = logging.getLogger(__name__)


class NonFiniteLoss(RunError):
    """``train.max_nonfinite`` non-finite losses in a row: the run stops with one line."""


def finite_on_every_rank(loss: Tensor) -> Tensor:
    """[] bool: the loss is finite on every rank (an all-reduce, no host synchronisation)."""
    flag = torch.isfinite(loss.detach()).float().reshape(1)
    if active():
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return flag[0] > 0


class MetricWindow:
    """Sums of per-step metric tensors over the steps since the last report."""

    def __init__(self) -> None:
        self.sums: dict[str, Tensor] = {}
        self.steps = 0

    def add(self, metrics: dict[str, Tensor]) -> None:
        """Add a step's metrics; a non-finite value counts as 0 (as if not measured)."""
        for key, value in metrics.items():
            value = value.detach().float().reshape(())
            value = torch.where(torch.isfinite(value), value, value.new_zeros(()))
            self.sums[key] = self.sums[key] + value if key in self.sums else value
        self.steps += 1

    def means_over_ranks(self) -> dict[str, float]:
        """The window's per-step means, averaged over ranks: one all-reduce, one transfer."""
        if not self.sums:
            return {}
        packed = torch.stack(list(self.sums.values())) / max(1, self.steps)
        if active():
            dist.all_reduce(packed)
            packed /= dist.get_world_size()
        means = dict(zip(self.sums, packed.tolist(), strict=True))
        self.sums, self.steps = {}, 0
        return means


class NonFiniteGuard:
    """Counts non-finite steps on the device; :meth:`check` reads the counts (one host
    synchronisation), logs the skipped updates and stops the run after ``limit`` in a row.
    """

    def __init__(self, limit: int, device: torch.device, total: int = 0) -> None:
        self.limit = limit
        self.total = total  # over the run, as of the last check
        self.in_row = torch.zeros((), dtype=torch.long, device=device)
        self.longest = torch.zeros((), dtype=torch.long, device=device)  # since last check
        self.new = torch.zeros((), dtype=torch.long, device=device)

    def record(self, finite: Tensor) -> None:
        skipped = (~finite).long()
        self.in_row = (self.in_row + 1) * skipped
        self.longest = torch.maximum(self.longest, self.in_row)
        self.new = self.new + skipped

    def check(self, step: int) -> int:
        """Warn about the skipped updates since the last check and stop after ``limit`` in a
        row; returns the run's total of non-finite steps."""
        new, in_row, longest = (int(v) for v in torch.stack(
            [self.new, self.in_row, self.longest]).tolist())
        self.new.zero_()
        self.longest.copy_(self.in_row)
        if new:
            self.total += new
            log.warning("non-finite loss in %d step(s) up to step %d; update skipped (%d in a "
                        "row, %d in total)", new, step, in_row, self.total)
        if longest >= self.limit:
            raise NonFiniteLoss(
                f"{longest} non-finite losses in a row (train.max_nonfinite={self.limit}) by "
                f"step {step}: lower optim.lr, raise objective.temperature or use "
                f"train.precision=fp32")
        return self.total
