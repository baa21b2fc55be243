"""Optimisers and the learning-rate schedule: LARS (You et al. 2017, as SimCLR and X-CLR
train), SGD and AdamW; linear warmup then cosine decay.

Biases and normalisation weights (every parameter with fewer than 2 dimensions), and the
parameters a module names in ``no_weight_decay()`` (timm's ViT position embeddings and class
token), get no weight decay and, under LARS, no trust-ratio adaptation (SimCLR appendix B.1).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

from core.config import InvalidValue


@dataclass
class OptimConfig:
    """``optim.*``. ``lr`` is per 256 images (scaled by global batch / 256, SimCLR's rule)."""

    name: Literal["lars", "sgd", "adamw"] = "lars"  # the optimiser
    lr: float = 0.3  # learning rate per 256 images of global batch
    weight_decay: float = 1e-6  # on weights (>= 2 dims); biases and norms get none
    momentum: float = 0.9  # lars, sgd: momentum
    trust_coefficient: float = 0.001  # lars: eta of the layer-wise trust ratio
    warmup_steps: int = 10  # linear warmup steps before the cosine decay
    betas: tuple[float, float] = (0.9, 0.999)  # adamw: moment decay rates

    def validate(self) -> None:
        if not self.lr > 0:
            raise InvalidValue("lr", f"must be > 0, got {self.lr}")
        if self.weight_decay < 0:
            raise InvalidValue("weight_decay", f"must be >= 0, got {self.weight_decay}")
        if self.warmup_steps < 0:
            raise InvalidValue("warmup_steps", f"must be >= 0, got {self.warmup_steps}")


class LARS(torch.optim.Optimizer):
    """SGD with momentum and a layer-wise trust ratio.

    For an adapted parameter w with gradient g: d = g + wd * w,
    ratio = eta * ||w|| / ||d|| (1 when either norm is 0), v = momentum * v + lr * ratio * d,
    w -= v. Groups with ``adapt=False`` skip the weight decay and the ratio.

    Like torch's fused optimisers under a GradScaler, it reads ``self.found_inf`` (a
    float tensor, 1 = skip): when set and nonzero, weights and velocities stay as they were,
    decided on the device without a host synchronisation (:func:`step_unless`).
    """

    def __init__(self, params: Iterable, lr: float, momentum: float = 0.9,
                 weight_decay: float = 0.0, trust_coefficient: float = 0.001) -> None:
        defaults = {"lr": lr, "momentum": momentum, "weight_decay": weight_decay,
                    "trust_coefficient": trust_coefficient, "adapt": True}
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None if closure is None else closure()
        found_inf = getattr(self, "found_inf", None)
        skip = None if found_inf is None else found_inf.reshape(()) > 0
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                d = p.grad
                if group["adapt"]:
                    d = d.add(p, alpha=group["weight_decay"])
                    w_norm, d_norm = p.norm(), d.norm()
                    ratio = torch.where((w_norm > 0) & (d_norm > 0),
                                        group["trust_coefficient"] * w_norm / d_norm,
                                        torch.ones_like(w_norm))
                    d = d.mul(ratio)
                state = self.state[p]
                if "velocity" not in state:
                    state["velocity"] = torch.zeros_like(p)
                if skip is None:
                    velocity = state["velocity"].mul_(group["momentum"]).add_(
                        d, alpha=group["lr"])
                    p.sub_(velocity)
                    continue
                velocity = state["velocity"].mul(group["momentum"]).add_(d, alpha=group["lr"])
                state["velocity"].copy_(torch.where(skip, state["velocity"], velocity))
                p.copy_(torch.where(skip, p, p - velocity))
        return loss


def exempt_from_decay(model: nn.Module) -> set[str]:
    """Names of the parameters a module exempts from weight decay through the
    ``no_weight_decay()`` protocol (timm: ViT position embeddings and class tokens), as
    names in ``model``."""
    names: set[str] = set()
    for prefix, module in model.named_modules():
        exempt = getattr(module, "no_weight_decay", None)
        if callable(exempt):
            names |= {f"{prefix}.{name}" if prefix else name for name in exempt()}
    return names


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weights (>= 2 dims) decay and adapt; biases, norm weights and what a module exempts
    (:func:`exempt_from_decay`) do neither."""
    exempt = exempt_from_decay(model)
    trained = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    decay = [p for name, p in trained if p.ndim >= 2 and name not in exempt]
    plain = [p for name, p in trained if p.ndim < 2 or name in exempt]
    return [{"params": decay, "weight_decay": weight_decay, "adapt": True},
            {"params": plain, "weight_decay": 0.0, "adapt": False}]


def build_optimizer(model: nn.Module, cfg: OptimConfig, global_batch: int,
                    extra: Iterable[nn.Parameter] = ()) -> torch.optim.Optimizer:
    """The configured optimiser at lr * global_batch / 256; ``extra`` parameters (a
    learnable temperature) join the no-decay group."""
    lr = cfg.lr * global_batch / 256
    groups = parameter_groups(model, cfg.weight_decay)
    groups[1]["params"] = groups[1]["params"] + list(extra)
    if cfg.name == "lars":
        return LARS(groups, lr=lr, momentum=cfg.momentum,
                    trust_coefficient=cfg.trust_coefficient)
    for group in groups:
        group.pop("adapt")
    # fused: one kernel per step, and it honours found_inf (a skip decided on the device)
    if cfg.name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=cfg.momentum, fused=True)
    return torch.optim.AdamW(groups, lr=lr, betas=cfg.betas, fused=True)


def step_unless(optimizer: torch.optim.Optimizer, skip: Tensor) -> None:
    """``optimizer.step()``, leaving weights and state untouched where ``skip`` [] (bool,
    on the device) is true: no host synchronisation (torch's fused optimisers and
    :class:`LARS` read ``found_inf``, as under a GradScaler)."""
    if isinstance(optimizer, torch.optim.SGD):  # a skipped first step must leave zeros
        for group in optimizer.param_groups:
            for p in group["params"]:
                if group["momentum"] and "momentum_buffer" not in optimizer.state[p]:
                    optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p)
    optimizer.found_inf = skip.float().reshape(())
    try:
        optimizer.step()
    finally:
        optimizer.found_inf = None


def warmup_cosine(total_steps: int, warmup_steps: int):
    """Multiplier of the base lr at a step: linear warmup from 1/warmup, then cosine to 0."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

    return factor
