"""What a :class:`~pretrain.loop.trainer.Trainer` reports to and watches with: the
:class:`Reports` it receives (MLflow, the ledger, the FLOP count, the kNN monitor) and the
:class:`Monitors` it builds (the metric window, the non-finite guard, the collapse watch)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from data_pipeline.loader.ledger import LedgerWriter
from pretrain.loop.collapse import CollapseWatch
from pretrain.loop.device_metrics import MetricWindow, NonFiniteGuard
from pretrain.loop.utilisation import Utilisation


@dataclass
class Monitors:
    """What watches the run: the metric ``window`` and the non-finite ``guard`` (both on
    the device until a report), the ``collapse`` watch and the optional ``knn`` monitor
    (encoder -> kNN top-1 on a fixed subset of the evaluation shards)."""

    guard: NonFiniteGuard
    collapse: CollapseWatch
    knn: Callable[[torch.nn.Module], dict[str, float]] | None = None
    window: MetricWindow = field(default_factory=MetricWindow)


@dataclass
class Reports:
    """Where a run's numbers go besides the console: the ``tracker`` (MLflow, started, on
    rank 0 with ``tracking.enabled``), the ``ledger`` (``data.ledger``: the samples of
    every step, per rank), the ``utilisation`` behind ``train/tflops`` and ``train/mfu``,
    and the ``knn`` monitor (``train.knn_every``: encoder -> kNN top-1)."""

    tracker: Any = None
    ledger: LedgerWriter | None = None
    utilisation: Utilisation | None = None
    knn: Callable[[torch.nn.Module], dict[str, float]] | None = None
