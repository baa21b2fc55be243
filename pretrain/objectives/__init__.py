"""The objectives, one file per paper, each opening with its plain mathematical form;
``docs/objectives.md`` defines what each one computes.

Every objective is a pure function ``(batch: ContrastiveBatch, temperature, **hparams) ->
ObjectiveOutput(loss, metrics)``, written in ``pretrain.contrast``'s vocabulary; none
touches torch.distributed. The gathering boundary builds a distributed
:class:`ContrastiveBatch`; :func:`batch_loss` builds the single-process one, so both paths
run the same code. ``table`` holds every objective and what each needs from the run;
``config`` the ``objective.*`` keys.

May import ``pretrain.contrast`` and ``core`` only: never the model, the loop or
torch.distributed.
"""

from __future__ import annotations

from torch import Tensor

from pretrain.contrast.batch import BatchOptions, BatchRows, ContrastiveBatch, local_batch
from pretrain.contrast.common import ObjectiveOutput, Temperature
from pretrain.contrast.temperature import EssControlConfig, EssTemperatureController
from pretrain.objectives.config import ObjectiveConfig
from pretrain.objectives.table import (
    OBJECTIVES,
    ObjectiveFn,
    ObjectiveSpec,
    declared,
    objective_function,
    objective_spec,
)


def batch_loss(
    name: str,
    z: Tensor,
    ids: Tensor,
    labels: Tensor | None = None,
    *,
    temperature: Temperature,
    captions: Tensor | None = None,
    class_graph: Tensor | None = None,
    text: Tensor | None = None,
    num_negatives: int | None = None,
    negatives_seed: int = 0,
    tile_size: int | None = None,
    num_classes: int | None = None,
    **hparams: object,
) -> ObjectiveOutput:
    """Objective ``name`` on one whole multiviewed batch in a single process.

    Args:
        z: [N, D] un-normalised embeddings (all views of all images).
        ids: [N] instance ids; the views of one image share an id.
        labels: [N] class labels (supervised objectives, class graph lookup).
        temperature: tau, a float or a 0-dim tensor (learnable temperature / logit scale).
        captions: [N, E] caption embeddings (``xclr``).
        class_graph: [C, C] class-similarity matrix (``xclr``, ImageNet recipe).
        text: [N, D] text embeddings paired row by row with ``z`` (``clip``).
        num_negatives: per-anchor seeded random subset of k negatives; None keeps all.
        tile_size: compute over column tiles of this width (no [N, N] tensor, the same
            values and gradients); None: dense up to ``DENSE_MAX_CANDIDATES``, tiles above.
        num_classes: C when labels lie in [0, C): label groups are the classes (fixed
            shapes of size C instead of N slots); a class graph gives its own C.
        hparams: the objective's own keyword arguments (``eps``, ``gamma``, ...).
    Returns:
        ``ObjectiveOutput(loss, metrics)``, equal to what the distributed path computes on
        the same batch.
    """
    for arg, value in (("z", z), ("ids", ids), ("labels", labels)):
        if value is not None and not isinstance(value, Tensor):
            raise TypeError(f"batch_loss: {arg} must be a tensor, got {type(value).__name__} "
                            f"{value!r} (temperature and hyperparameters are keywords)")
    batch = local_batch(BatchRows(z, ids, labels, captions, text),
                        BatchOptions(class_graph, num_negatives, negatives_seed, tile_size,
                                     num_classes))
    return objective_function(name, **hparams)(batch, temperature)


__all__ = [
    "OBJECTIVES", "BatchOptions", "BatchRows", "ContrastiveBatch", "EssControlConfig",
    "EssTemperatureController", "ObjectiveConfig", "ObjectiveFn", "ObjectiveOutput",
    "ObjectiveSpec", "Temperature", "batch_loss", "declared", "local_batch",
    "objective_function",
    "objective_spec",
]
