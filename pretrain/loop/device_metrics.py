"""Step bookkeeping that stays on the device: the metric window and the non-finite guard.

A step adds its metrics and its finite flag as tensor operations; nothing turns into a
Python number until the window is reported, once per ``train.log_every`` steps, with one
all-reduce and one transfer for all metrics. On a GPU this keeps the host from waiting on
the device every step (``docs/training.md``, "Host synchronisation").
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from core.collectives import active
from core.errors import RunError

log = logging.getLogger(__name__)


class NonFiniteLoss(RunError):
    """``train.max_nonfinite`` non-finite losses in a row: the run stops with one line."""


class StepFlags(NamedTuple):
    """What every rank agrees on about a step, as [] bool device tensors."""

    finite: Tensor  # the loss is finite on every rank
    real: Tensor  # no rank's batch is a placeholder (every sample skipped)

    @property
    def update(self) -> Tensor:
        return self.finite & self.real


def agreed_flags(loss: Tensor, placeholder: bool = False) -> StepFlags:
    """:class:`StepFlags` of this step: one all-reduce of two flags, no host
    synchronisation (``placeholder`` is the loader's host-side flag)."""
    # the placeholder flag is filled on the device: a tensor made on the host and moved
    # there would be a transfer every step
    flags = torch.stack([torch.isfinite(loss.detach()).float().reshape(()),
                         torch.full((), 0.0 if placeholder else 1.0, device=loss.device)])
    if active():
        dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    return StepFlags(flags[0] > 0, flags[1] > 0)


@contextmanager
def kept_buffers(module: torch.nn.Module, keep: bool) -> Iterator[None]:
    """With ``keep``, the module's buffers (batch-norm running statistics) are restored
    after the body: a placeholder batch's zero images leave no trace in them."""
    saved = [(buffer, buffer.detach().clone()) for buffer in module.buffers()] if keep else []
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in saved:
                buffer.copy_(value)


def finite_on_every_rank(loss: Tensor) -> Tensor:
    """[] bool: the loss is finite on every rank (an all-reduce, no host synchronisation)."""
    return agreed_flags(loss).finite


class MetricWindow:
    """Sums of per-step metric tensors over the steps since the last report, each metric
    averaged over the steps that measured it (the effective rank is measured on the
    reporting step only)."""

    def __init__(self) -> None:
        self.sums: dict[str, Tensor] = {}
        self.counts: dict[str, Tensor | float] = {}  # steps that measured each metric
        self.steps: Tensor | int = 0  # the steps counted (a device tensor once one is added)

    def add(self, metrics: dict[str, Tensor], counted: Tensor | None = None) -> None:
        """Add a step's metrics; a non-finite value counts as 0 (as if not measured). A
        step with ``counted`` false ([] bool, agreed by every rank: a placeholder step)
        adds nothing."""
        weight = None if counted is None else counted.float()
        for key, value in metrics.items():
            value = value.detach().float().reshape(())
            value = torch.where(torch.isfinite(value), value, value.new_zeros(()))
            if weight is not None:
                value = value * weight
            self.sums[key] = self.sums[key] + value if key in self.sums else value
            self.counts[key] = self.counts.get(key, 0.0) + (1.0 if weight is None else weight)
        self.steps = self.steps + (1 if weight is None else weight)

    def means_over_ranks(self) -> dict[str, float]:
        """The window's per-step means, averaged over ranks: one all-reduce, one transfer;
        empty when no step of the window was counted."""
        steps = float(self.steps)  # the report's read; equal on every rank (agreed flags)
        if not self.sums or not steps:  # nothing measured (every step a placeholder)
            self.sums, self.steps = {}, 0
            return {}
        counts = torch.stack([torch.as_tensor(self.counts[k], dtype=torch.float32,
                                              device=v.device) for k, v in self.sums.items()])
        packed = torch.stack(list(self.sums.values())) / counts.clamp(min=1)
        if active():
            dist.all_reduce(packed)
            packed /= dist.get_world_size()
        means = dict(zip(self.sums, packed.tolist(), strict=True))
        self.sums, self.counts, self.steps = {}, {}, 0
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
