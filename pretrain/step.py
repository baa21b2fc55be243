"""One training step's forward: model outputs -> global batch -> objective.

The trainer and the distributed equivalence tests both call :func:`forward_loss`, so the
tests check the code that trains.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from data_pipeline.samples import stable_int
from pretrain.collapse import backbone_measures, effective_rank
from pretrain.distributed import build_global_batch
from pretrain.losses import ObjectiveConfig, ObjectiveOutput
from pretrain.losses.batch import BatchOptions, BatchRows
from pretrain.model import ModelOutput


def step_seed(objective: ObjectiveConfig, step: int) -> int:
    """The negatives subset is redrawn every step, reproducibly (and on resume)."""
    return stable_int(objective.negatives_seed, step) % 2**31


def forward_loss(model: Callable[..., Any], batch: dict[str, Any], objective: Callable,
                 cfg: ObjectiveConfig, temperature: float, step: int,
                 class_graph: Tensor | None = None) -> ObjectiveOutput:
    """Objective output of this rank's anchors against the global batch, with the
    effective rank of this rank's embeddings among the metrics (collapse detection).

    ``batch`` holds this rank's tensors on the model's device: ``images`` [2B, 3, R, R],
    ``ids`` [2B], optional ``labels`` [2B], ``caption_embeddings`` [2B, E],
    ``input_ids``/``attention_mask`` [2B, L] (clip; the text tower encodes each distinct
    caption once). ``temperature`` is used unless the
    model learns its own.
    """
    return loss_of_outputs(model(*model_inputs(batch)), batch, objective, cfg, temperature,
                           step, class_graph)


def model_inputs(batch: dict[str, Any], rows: slice = slice(None)) -> tuple:
    """(images, input_ids, attention_mask) of ``rows`` of the batch, as the model takes them."""
    ids, mask = batch.get("input_ids"), batch.get("attention_mask")
    return (batch["images"][rows], None if ids is None else ids[rows],
            None if mask is None else mask[rows])


def loss_of_outputs(out: ModelOutput, batch: dict[str, Any], objective: Callable,
                    cfg: ObjectiveConfig, temperature: float, step: int,
                    class_graph: Tensor | None = None) -> ObjectiveOutput:
    """The objective on this rank's model outputs (``out.projections`` [2B, P], the
    ``text`` [2B, P] of clip and siglip, a learnable ``temperature`` [] and the learnable
    ``loss_parameters``, each []) against the global batch."""
    captions = batch.get("caption_embeddings")
    rows = BatchRows(out.projections, batch["ids"], batch.get("labels"),
                     None if captions is None else captions.float(), out.text)
    options = BatchOptions(class_graph, cfg.num_negatives, step_seed(cfg, step),
                           cfg.tile_size)
    global_batch = build_global_batch(rows, options)
    tau = temperature if out.temperature is None else out.temperature
    result = objective(global_batch, tau, **out.loss_parameters)
    result.metrics["effective_rank"] = effective_rank(out.projections.detach())
    if out.features is not None:
        result.metrics.update(backbone_measures(out.features, batch["ids"]))
    return result


def to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: v.to(device, non_blocking=True) if isinstance(v, Tensor) else v
            for k, v in batch.items()}
