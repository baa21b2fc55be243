"""Configuration of the training objective (``objective.*`` in the run config)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from torch import Tensor

from core.config import InvalidValue
from pretrain.losses.objectives import objective_spec
from pretrain.losses.parameters import ParameterShape, initial_values
from pretrain.losses.projnce import Projection
from pretrain.losses.temperature import EssControlConfig


@dataclass
class ObjectiveConfig:
    """Which objective, its temperature, the negatives it sees and its hyperparameters.

    Objective-specific keys are read only by the objective named in the comment.
    """

    name: str = "infonce"  # an entry of pretrain/losses/objectives.py (docs/objectives.md)
    temperature: float = 0.1  # tau of the similarity logits (initial value if learnable)
    learnable_temperature: bool = False  # learn tau (stored as log tau) with the model
    num_negatives: int | None = None  # per-anchor random subset of k negatives; null = all
    negatives_seed: int = 0  # the subset is reseeded from (seed, step) every step
    tile_size: int | None = None  # column tile width (docs/negatives.md); null = automatic
    eps: float = 0.1  # eps_supinfonce: margin on the positive's denominator term
    gamma: float = 2.0  # holder_flatnce: scale of the logits
    target_temperature: float = 0.1  # xclr: tau_s of the soft targets
    bias: float = -10.0  # siglip: initial value of the learned logit bias b (Zhai et al.)
    class_graph: str = ""  # xclr: class_graph.npz (ImageNet recipe); "" = caption targets
    # learned: a [C, D] class-embedding matrix trained with the encoder (ProjNCE-MLP)
    projection: Projection = "centroid"  # projnce: the class projection g(c)
    bandwidth: float = 0.5  # projnce kernel: Nadaraya-Watson bandwidth h
    kernel_metric: Literal["l1", "l2", "cos"] = "l1"  # projnce kernel: distance
    ess_control: EssControlConfig = field(default_factory=EssControlConfig)  # ESS steering

    def validate(self) -> None:
        spec = objective_spec(self.name)
        for key in ("temperature", "gamma", "target_temperature", "bandwidth"):
            if not getattr(self, key) > 0:
                raise InvalidValue(key, f"must be > 0, got {getattr(self, key)}")
        if self.eps < 0:
            raise InvalidValue("eps", f"must be >= 0, got {self.eps}")
        if self.tile_size is not None and self.tile_size < 1:
            raise InvalidValue("tile_size", f"must be >= 1 or null, got {self.tile_size}")
        if self.num_negatives is not None and self.num_negatives < 1:
            raise InvalidValue("num_negatives", f"must be >= 1 or null, got {self.num_negatives}")
        if self.ess_control.enabled and self.learnable_temperature:
            raise InvalidValue("ess_control.enabled",
                               "cannot steer a learnable temperature; choose one")
        if self.ess_control.enabled and not spec.softmax:
            raise InvalidValue("ess_control.enabled",
                               f"{self.name} has no softmax over negatives to steer by ESS")

    def hparams(self) -> dict[str, Any]:
        """Keyword arguments of the chosen objective function (its table entry's keys)."""
        return {key: getattr(self, key) for key in objective_spec(self.name).hparams}

    def loss_parameters(self, shape: ParameterShape) -> dict[str, Tensor]:
        """Initial values of the learnable loss parameters the model owns for this
        objective, for a run of ``shape`` (its class count and projection width)."""
        return initial_values(objective_spec(self.name).parameters, vars(self), shape)
