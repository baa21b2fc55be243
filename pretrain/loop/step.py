"""One training step's forward: model outputs -> global batch -> objective.

The trainer and the distributed equivalence tests both call :func:`forward_loss`, so the
tests check the code that trains.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from data_pipeline.samples import stable_int
from pretrain.distributed import build_global_batch
from pretrain.loop.collapse import backbone_measures, effective_rank
from pretrain.losses import ObjectiveConfig, ObjectiveOutput
from pretrain.losses.batch import BatchOptions, BatchRows
from pretrain.model.encoder import ModelOutput


@dataclass(frozen=True)
class BatchSpec:
    """What a run knows of every global batch before it sees one, so that no step reads a
    count back from the device: the ``class_graph`` [C, C] (xclr), the number of classes C
    (labels lie in [0, C); None: unknown) and ``rows_per_rank``, the most rows a rank
    contributes (two views of its configured batch: the gather pads every rank to it;
    None: each rank's own rows, which must then be equal on every rank)."""

    class_graph: Tensor | None = None
    num_classes: int | None = None
    rows_per_rank: int | None = None


def step_seed(objective: ObjectiveConfig, step: int) -> int:
    """The negatives subset is redrawn every step, reproducibly (and on resume)."""
    return stable_int(objective.negatives_seed, step) % 2**31


def forward_loss(model: Callable[..., Any], batch: dict[str, Any], objective: Callable,
                 cfg: ObjectiveConfig, temperature: float, step: int,
                 spec: BatchSpec | None = None, measure_rank: bool = True) -> ObjectiveOutput:
    """Objective output of this rank's anchors against the global batch, with the
    effective rank of this rank's embeddings among the metrics (collapse detection) when
    ``measure_rank``: its singular values make the host wait for a GPU, so the trainer
    asks for it on the steps that report, not on every step.

    ``batch`` holds this rank's tensors on the model's device: ``images`` [2B, 3, R, R],
    ``ids`` [2B], optional ``labels`` [2B], ``caption_embeddings`` [2B, E],
    ``input_ids``/``attention_mask`` [2B, L] (clip; the text tower encodes each distinct
    caption once). ``temperature`` is used unless the
    model learns its own.
    """
    return loss_of_outputs(model(*model_inputs(batch)), batch, objective, cfg, temperature,
                           step, spec, measure_rank)


def model_inputs(batch: dict[str, Any], rows: slice = slice(None)) -> tuple:
    """(images, input_ids, attention_mask, text_repeats) of ``rows`` of the batch, as the
    model takes them. For the whole batch, when the loader says that its second half of
    token rows repeats the first (``text_repeated``: the views of an image share its
    caption), only the first half goes to the text tower (``text_repeats`` 2): decided on
    the host, where the loader built the batch, with no value read from the device."""
    ids, mask = batch.get("input_ids"), batch.get("attention_mask")
    if ids is None:
        return batch["images"][rows], None, None, 1
    if rows == slice(None) and batch.get("text_repeated"):
        half = ids.shape[0] // 2
        return batch["images"], ids[:half], mask[:half], 2
    return batch["images"][rows], ids[rows], mask[rows], 1


def loss_of_outputs(out: ModelOutput, batch: dict[str, Any], objective: Callable,
                    cfg: ObjectiveConfig, temperature: float, step: int,
                    spec: BatchSpec | None = None, measure_rank: bool = True,
                    ) -> ObjectiveOutput:
    """The objective on this rank's model outputs (``out.projections`` [2B, P], the
    ``text`` [2B, P] of clip and siglip, a learnable ``temperature`` [] and the learnable
    ``loss_parameters``, each []) against the global batch."""
    captions = batch.get("caption_embeddings")
    rows = BatchRows(out.projections, batch["ids"], batch.get("labels"),
                     None if captions is None else captions.float(), out.text)
    spec = spec or BatchSpec()
    options = BatchOptions(spec.class_graph, cfg.num_negatives, step_seed(cfg, step),
                           cfg.tile_size, spec.num_classes, spec.rows_per_rank)
    global_batch = build_global_batch(rows, options)
    tau = temperature if out.temperature is None else out.temperature
    result = objective(global_batch, tau, **out.loss_parameters)
    if measure_rank:
        result.metrics["effective_rank"] = effective_rank(out.projections.detach())
    if out.features is not None:
        result.metrics.update(backbone_measures(out.features, batch["ids"]))
    return result


def to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: v.to(device, non_blocking=True) if isinstance(v, Tensor) else v
            for k, v in batch.items()}
