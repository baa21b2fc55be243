"""Learnable loss parameters: tensors an objective learns beside the encoder.

The table of objectives declares them (:class:`LossParameter`); the model owns them (as
open_clip's model owns ``logit_bias``), the optimiser trains them, checkpoints and the
model registry keep them, and the step hands them to the objective as keywords. Each
declaration says how to make its initial tensor from the run's shape
(:class:`ParameterShape`) and the objective's ``objective.*`` values, or that the
objective does not use it with those values (``None``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor


class ParameterShape(NamedTuple):
    """What a loss parameter may be shaped by: the run's class count and embedding width."""

    num_classes: int  # C: classes the shards list (0 when they list none)
    dim: int  # D: width of the projections the objective sees


Initial = Callable[[Mapping[str, Any], ParameterShape], "Tensor | None"]


@dataclass(frozen=True)
class LossParameter:
    """A learnable tensor handed to the objective as keyword ``name``."""

    name: str
    initial: Initial  # (objective.* values, shape) -> initial tensor, None when unused


def scalar_from(key: str) -> Initial:
    """A 0-dim parameter starting at ``objective.<key>`` (SigLIP's bias)."""
    return lambda values, shape: torch.tensor(float(values[key]))


def class_embeddings_when_learned(values: Mapping[str, Any],
                                  shape: ParameterShape) -> Tensor | None:
    """ProjNCE-MLP's [C, D] class-embedding matrix (Jeong & Hero, eq. 34) when
    ``objective.projnce.projection=learned``: rows drawn from N(0, 1/D) under the run's seed, so
    that after normalisation they point in independent random directions, nearly
    orthogonal for D >> log C (as a freshly initialised linear layer of one-hot inputs)."""
    if values.get("projection") != "learned":
        return None
    if shape.num_classes < 1:
        raise ValueError("projnce learned: the shards list no classes to embed")
    return torch.randn(shape.num_classes, shape.dim) / shape.dim**0.5


def initial_values(parameters: tuple[LossParameter, ...], values: Mapping[str, Any],
                   shape: ParameterShape) -> dict[str, Tensor]:
    """{name: initial tensor} of the declared parameters the objective uses."""
    made = {p.name: p.initial(values, shape) for p in parameters}
    return {name: tensor for name, tensor in made.items() if tensor is not None}
