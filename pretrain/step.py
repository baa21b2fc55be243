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
from pretrain.collapse import effective_rank
from pretrain.distributed import build_global_batch
from pretrain.losses import ObjectiveConfig, ObjectiveOutput


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
    out = model(*model_inputs(batch))
    return loss_of_outputs(out.projections, out.text, out.temperature, batch, objective, cfg,
                           temperature, step, class_graph)


def model_inputs(batch: dict[str, Any], rows: slice = slice(None)) -> tuple:
    """(images, input_ids, attention_mask) of ``rows`` of the batch, as the model takes them."""
    ids, mask = batch.get("input_ids"), batch.get("attention_mask")
    return (batch["images"][rows], None if ids is None else ids[rows],
            None if mask is None else mask[rows])


def loss_of_outputs(projections: Tensor, text: Tensor | None, learned_tau: Tensor | None,
                    batch: dict[str, Any], objective: Callable, cfg: ObjectiveConfig,
                    temperature: float, step: int,
                    class_graph: Tensor | None = None) -> ObjectiveOutput:
    """The objective on this rank's model outputs (``projections`` [2B, P], CLIP's ``text``
    [2B, P], a learnable temperature []) against the global batch."""
    captions = batch.get("caption_embeddings")
    global_batch = build_global_batch(
        projections, batch["ids"], labels=batch.get("labels"),
        captions=None if captions is None else captions.float(),
        text=text, class_graph=class_graph, num_negatives=cfg.num_negatives,
        negatives_seed=step_seed(cfg, step), tile_size=cfg.tile_size)
    result = objective(global_batch, temperature if learned_tau is None else learned_tau)
    result.metrics["effective_rank"] = effective_rank(projections.detach())
    return result


def to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: v.to(device, non_blocking=True) if isinstance(v, Tensor) else v
            for k, v in batch.items()}
