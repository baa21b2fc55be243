"""Optimisers and the learning-rate schedule: LARS (You et al. 2017, as SimCLR and X-CLR
train), SGD and AdamW; linear warmup then cosine decay.

Biases and normalisation weights (every parameter with fewer than 2 dimensions), and the
parameters a module names in ``no_weight_decay()`` (timm's ViT position embeddings and class
token), get no weight decay and, under LARS, no trust-ratio adaptation (SimCLR appendix B.1).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from core.config import ConfigError, InvalidValue
from core.tables import table_entry


@dataclass
class OptimConfig:
    """``optim.*``. ``lr`` is per 256 images (scaled by global batch / 256, SimCLR's rule)."""

    name: str = "lars"  # an entry of OPTIMIZERS: lars, sgd or adamw
    lr: float = 0.3  # learning rate per 256 images of global batch
    weight_decay: float = 1e-6  # on weights (>= 2 dims); biases and norms get none
    momentum: float = 0.9  # lars, sgd: momentum
    trust_coefficient: float = 0.001  # lars: eta of the layer-wise trust ratio
    warmup_steps: int = 10  # linear warmup steps before the cosine decay
    betas: tuple[float, float] = (0.9, 0.999)  # adamw: moment decay rates
    # block i of a timm backbone's L trains at lr * layer_decay^(L - 1 - i), its stem at
    # lr * layer_decay^L, the heads at lr (BEiT, MAE; timm's layer map)
    layer_decay: float = 1.0  # layer-wise lr decay of timm backbones; 1 = off
    # the learnable temperature and loss parameters (SigLIP's bias, ProjNCE's class
    # embeddings) train at lr * loss_lr_scale
    loss_lr_scale: float = 1.0  # lr scale of the objective's own parameters; 1 = the lr

    def validate(self) -> None:
        optimizer_spec(self.name)
        if not self.lr > 0:
            raise InvalidValue("lr", f"must be > 0, got {self.lr}")
        if not self.loss_lr_scale > 0:
            raise InvalidValue("loss_lr_scale", f"must be > 0, got {self.loss_lr_scale}")
        if not 0 < self.layer_decay <= 1:
            raise InvalidValue("layer_decay", f"must lie in (0, 1], got {self.layer_decay}")
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
    decided on the device without a host synchronisation
    (``pretrain.distributed.engine_base.step_unless``).
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


def layer_lr_scales(model: nn.Module, layer_decay: float) -> dict[int, float]:
    """{id(parameter): lr scale} of the parameters of every timm backbone in ``model``
    under layer-wise decay (timm's ``param_groups_layer_decay`` over the backbone's
    ``group_matcher()`` layers); parameters it does not list train at scale 1."""
    if layer_decay == 1.0:
        return {}
    from timm.optim import param_groups_layer_decay

    backbones = [m for m in model.modules() if callable(getattr(m, "group_matcher", None))]
    if not backbones:
        raise ConfigError("key 'optim.layer_decay': needs a backbone that declares its "
                          "layers (a timm model, model.backbone=timm:<name>); set it to 1")
    scales = {}
    for backbone in backbones:
        for group in param_groups_layer_decay(backbone, 0.0, layer_decay=layer_decay):
            scales.update({id(p): group["lr_scale"] for p in group["params"]})
    return scales


LOSS_PARAMETERS = ("log_temperature", "loss_parameters.")  # the objective's own parameters


def parameter_groups(model: nn.Module, weight_decay: float, layer_decay: float = 1.0,
                     loss_lr_scale: float = 1.0) -> list[dict]:
    """Weights (>= 2 dims) decay and adapt; biases, norm weights and what a module exempts
    (:func:`exempt_from_decay`) do neither. Without layer decay or a loss-parameter lr
    scale: [decayed, plain]; with them, one group per (decayed or plain, lr scale), each
    with its ``lr_scale``."""
    exempt = exempt_from_decay(model)
    scales = layer_lr_scales(model, layer_decay)
    scales.update({id(p): loss_lr_scale for name, p in model.named_parameters()
                   if name.startswith(LOSS_PARAMETERS) and loss_lr_scale != 1.0})
    groups: dict[tuple[bool, float], list[nn.Parameter]] = {(True, 1.0): [], (False, 1.0): []}
    for name, p in model.named_parameters():
        if p.requires_grad:
            decays = p.ndim >= 2 and name not in exempt
            groups.setdefault((decays, scales.get(id(p), 1.0)), []).append(p)
    return [{"params": params, "weight_decay": weight_decay if decays else 0.0,
             "adapt": decays, "lr_scale": scale}
            for (decays, scale), params in groups.items() if params or scale == 1.0]


def build_optimizer(model: nn.Module, cfg: OptimConfig, global_batch: int,
                    extra: Iterable[nn.Parameter] = ()) -> torch.optim.Optimizer:
    """The configured optimiser at lr * global_batch / 256 (times each group's layer-decay
    scale); ``extra`` parameters (a learnable temperature) join the plain group."""
    lr = cfg.lr * global_batch / 256
    groups = parameter_groups(model, cfg.weight_decay, cfg.layer_decay, cfg.loss_lr_scale)
    groups[1]["params"] = groups[1]["params"] + list(extra)
    spec = optimizer_spec(cfg.name)
    for group in groups:
        group["lr"] = lr * group.pop("lr_scale")
        if not spec.per_layer:
            group.pop("adapt")
    return spec.build(groups, lr, cfg)


@dataclass(frozen=True)
class OptimizerSpec:
    """An optimiser and what it needs."""

    build: Callable[[list[dict], float, OptimConfig], torch.optim.Optimizer]  # groups, lr
    # its update reads a whole layer (LARS's trust ratio; the groups say which adapt):
    # inside ZeRO it would see a flat partition instead
    per_layer: bool = False


# torch's fused SGD and AdamW: one kernel per step, and they honour found_inf (a skip
# decided on the device), as LARS does
OPTIMIZERS: dict[str, OptimizerSpec] = {
    "lars": OptimizerSpec(lambda groups, lr, cfg: LARS(
        groups, lr=lr, momentum=cfg.momentum, trust_coefficient=cfg.trust_coefficient),
        per_layer=True),
    "sgd": OptimizerSpec(lambda groups, lr, cfg: torch.optim.SGD(
        groups, lr=lr, momentum=cfg.momentum, fused=True)),
    "adamw": OptimizerSpec(lambda groups, lr, cfg: torch.optim.AdamW(
        groups, lr=lr, betas=cfg.betas, fused=True)),
}


def optimizer_spec(name: str) -> OptimizerSpec:
    """The entry of optimiser ``name``; :class:`InvalidValue` for ``optim.name`` naming
    the choices, if there is none."""
    return table_entry(OPTIMIZERS, name, "name", "optimizer")


def warmup_cosine(total_steps: float, warmup_steps: float) -> Callable[[float], float]:
    """Multiplier of the base lr at a step: linear warmup from 1/warmup, then cosine to 0."""

    def factor(step: float) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

    return factor


def warmup_cosine_in_samples(total_samples: int, samples_per_step: int,
                             warmup_steps: int) -> Callable[[int], float]:
    """The multiplier of the base lr after ``samples`` samples of a run of
    ``total_samples``: :func:`warmup_cosine` over global batches of ``samples_per_step``,
    one curve in samples through any change of world."""
    factor = warmup_cosine(total_samples / samples_per_step, warmup_steps)

    def of_samples(samples: int) -> float:
        return factor(samples / samples_per_step)

    return of_samples
