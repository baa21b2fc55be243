"""ESS temperature control (FlatNCE Sec. 3.3 and appendix C, Algorithm S1);
docs/objectives.md, "ESS temperature control".

The paper's aim is to "train with the targeted level of ESS", adapting the inverse
temperature beta = 1/tau multiplicatively by a rate r after every step. A higher beta
(lower tau) sharpens the softmax over the negatives and *lowers* ESS. Algorithm S1 as
printed multiplies beta by (1 - r) when ESS is above the target,
which flattens the softmax and raises ESS further: positive feedback that runs to ESS = 1
(``tests/pretrain/contrast/test_temperature.py`` shows it). This controller applies the
stated aim with the stabilising sign: ESS above target -> beta *= (1 + r); below ->
beta *= (1 - r). The target may move linearly or along a cosine from ``target`` to
``final_target`` over training (the paper relaxes it from high to low).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from core.config import InvalidValue


@dataclass
class EssControlConfig:
    """``objective.ess_control.*``: off by default."""

    enabled: bool = False  # steer the temperature towards a target ESS
    target: float = 0.5  # the ESS target (at the start of training)
    final_target: float | None = None  # None keeps ``target`` throughout
    schedule: Literal["constant", "linear", "cosine"] = "constant"  # target path over training
    rate: float = 0.01  # r: beta = 1/tau is multiplied by (1 +- r) each step
    min_temperature: float = 0.01  # lower bound of the steered temperature
    max_temperature: float = 10.0  # upper bound of the steered temperature

    def validate(self) -> None:
        for key in ("target", "final_target"):
            value = getattr(self, key)
            if value is not None and not 0 < value <= 1:
                raise InvalidValue(key, f"an ESS target lies in (0, 1], got {value}")
        if not 0 < self.rate < 1:
            raise InvalidValue("rate", f"must lie in (0, 1), got {self.rate}")
        if not 0 < self.min_temperature < self.max_temperature:
            raise InvalidValue("min_temperature",
                               "need 0 < min_temperature < max_temperature")


class EssTemperatureController:
    """Multiplicative controller of the temperature from the measured batch-mean ESS."""

    def __init__(self, config: EssControlConfig, temperature: float) -> None:
        self.config = config
        self.temperature = temperature

    def target_at(self, progress: float) -> float:
        """The ESS target at ``progress`` in [0, 1] of training."""
        cfg = self.config
        if cfg.final_target is None or cfg.schedule == "constant":
            return cfg.target
        progress = min(max(progress, 0.0), 1.0)
        mix = progress if cfg.schedule == "linear" else 0.5 * (1 - math.cos(math.pi * progress))
        return cfg.target + (cfg.final_target - cfg.target) * mix

    def update(self, ess: float | Tensor, progress: float = 0.0) -> float | Tensor:
        """Apply one step of the rule for the measured ``ess``; returns the new temperature.

        Given a tensor (the trainer's ESS, on the device) the rule runs as tensor operations
        and the temperature becomes a 0-dim tensor: no host synchronisation per step.
        """
        cfg = self.config
        above = ess > self.target_at(progress)
        if isinstance(above, Tensor):
            factor = torch.where(above, 1 + cfg.rate, 1 - cfg.rate)
            temperature = torch.as_tensor(self.temperature, device=above.device,
                                          dtype=torch.float32)
            self.temperature = (temperature / factor).clamp(cfg.min_temperature,
                                                           cfg.max_temperature)
            return self.temperature
        beta = 1.0 / self.temperature
        beta *= (1 + cfg.rate) if above else (1 - cfg.rate)
        self.temperature = min(max(1.0 / beta, cfg.min_temperature), cfg.max_temperature)
        return self.temperature

    def state_dict(self) -> dict[str, float]:
        return {"temperature": float(self.temperature)}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.temperature = float(state["temperature"])
