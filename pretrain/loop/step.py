"""What a training step works with besides its loop (``trainer.py``): the
:class:`Objective` a run trains with, and the batch as the model takes it."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from data_pipeline.samples import stable_int
from pretrain.objectives import (
    BatchOptions,
    ContrastiveBatch,
    EssTemperatureController,
    ObjectiveConfig,
    ObjectiveOutput,
    ObjectiveSpec,
    declared,
    objective_spec,
)


@dataclass
class Objective:
    """The loss a run trains with: ``fn``, the table's function with the objective's own
    keys bound (``fn(global_batch, temperature, **loss_parameters)``, called within
    :meth:`declared`), its entry and its configuration,
    the temperature (fixed, or steered towards a target ESS), and what the run knows of
    every global batch before it sees one, so that no step reads a count back from the
    device: the ``class_graph`` [C, C] (xclr), the number of classes C (labels lie in
    [0, C); None: unknown) and ``rows_per_rank``, the most rows a rank contributes (two
    views of its configured batch: the gather pads every rank to it; None: each rank's own
    rows, which must then be equal on every rank)."""

    cfg: ObjectiveConfig
    class_graph: Tensor | None = None
    num_classes: int | None = None
    rows_per_rank: int | None = None
    spec: ObjectiveSpec = field(init=False)
    fn: Callable[..., ObjectiveOutput] = field(init=False)
    controller: EssTemperatureController | None = field(init=False)

    def __post_init__(self) -> None:
        self.spec = objective_spec(self.cfg.name)
        self.fn = self.spec.bound(**self.cfg.hparams())
        ess = self.cfg.ess_control
        self.controller = (EssTemperatureController(ess, self.cfg.temperature)
                           if ess.enabled else None)

    def declared(self, batch: ContrastiveBatch) -> contextlib.AbstractContextManager:
        """Around :attr:`fn` on the global ``batch``: the batch checked to hold what the
        entry declares, autocast off (``objectives.table.declared``)."""
        return declared(self.cfg.name, self.spec, batch)

    @property
    def temperature(self) -> float:
        """This step's temperature, unless the model learns its own."""
        return self.controller.temperature if self.controller else self.cfg.temperature

    def options(self, step: int) -> BatchOptions:
        """How the objective sees the global batch at ``step``; the negatives subset is
        redrawn every step, reproducibly (and on resume)."""
        seed = stable_int(self.cfg.negatives_seed, step) % 2**31
        return BatchOptions(self.class_graph, self.cfg.num_negatives, seed,
                            self.cfg.tile_size, self.num_classes, self.rows_per_rank)


def model_inputs(batch: dict[str, Any], rows: slice | Tensor = slice(None)) -> tuple:
    """(images, input_ids, attention_mask, text_repeats) of ``rows`` of the batch, as the
    model takes them. For the whole batch, when the loader says that its second half of
    token rows repeats the first (``text_repeated``: the views of an image share its
    caption), only the first half goes to the text tower (``text_repeats`` 2): decided on
    the host, where the loader built the batch, with no value read from the device."""
    ids, mask = batch.get("input_ids"), batch.get("attention_mask")
    if ids is None:
        return batch["images"][rows], None, None, 1
    whole = isinstance(rows, slice) and rows == slice(None)
    if whole and batch.get("text_repeated"):
        half = ids.shape[0] // 2
        return batch["images"], ids[:half], mask[:half], 2
    return batch["images"][rows], ids[rows], mask[rows], 1


def to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: v.to(device, non_blocking=True) if isinstance(v, Tensor) else v
            for k, v in batch.items()}
