"""The encoder: a backbone plus the 2-layer projector to 128 dimensions (SimCLR, X-CLR).

Backbones: torchvision ResNet-18 / ResNet-50 (``small_stem`` replaces the 7x7/2 stem and
max-pool by a 3x3/1 convolution for 32 px images, as SINCERE's CIFAR runs), and a small CNN
for fast CPU runs. ``Encoder.forward`` returns (features [B, F], projections [B, P]); the
objectives normalise the projections, evaluation uses the features.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

import torch
import torchvision
from torch import Tensor, nn

from core.config import InvalidValue
from pretrain.losses.config import ObjectiveConfig
from pretrain.losses.registry import objective_spec
from pretrain.text_tower import TextTower, TextTowerConfig


@dataclass
class ModelConfig:
    """``model.*``: the backbone and the projector."""

    backbone: Literal["small_cnn", "resnet18", "resnet50"] = "small_cnn"  # the encoder network
    width: int = 64  # small_cnn: channels of the first block (then x2, x4, x4)
    small_stem: bool = True  # resnet: 3x3/1 stem without max-pool, for 32-64 px images
    projector_hidden: int = 512  # hidden width of the 2-layer projector
    projector_dim: int = 128  # output width of the projector (the contrastive embedding)
    projector_bn_out: bool = True  # batch-normalise the output (SimCLR's head): no collapse
    norm: Literal["batch", "group"] = "batch"  # group: independent of the batch split
    sync_batchnorm: bool = True  # batch norm over the global batch on multi-GPU runs
    split_views: bool = False  # batch-norm statistics per view set (first views, second views)
    channels_last: bool = True  # channels-last memory format on GPU
    text: TextTowerConfig = field(default_factory=TextTowerConfig)  # clip's text tower

    def validate(self) -> None:
        for key in ("width", "projector_hidden", "projector_dim"):
            if getattr(self, key) < 1:
                raise InvalidValue(key, f"must be >= 1, got {getattr(self, key)}")
        if self.norm == "group" and self.projector_bn_out:
            raise InvalidValue("projector_bn_out", "norm=group makes the encoder independent "
                               "of how the batch is split, a batch-normalised output would "
                               "not be: set model.projector_bn_out=false with it")


def norm_layer(kind: str) -> Callable[[int], nn.Module]:
    """Batch norm, or group norm (8 groups), which gives every sample the same output
    however the global batch is split over ranks (no SyncBatchNorm on CPU/gloo)."""
    return nn.BatchNorm2d if kind == "batch" else (lambda channels: nn.GroupNorm(8, channels))


def small_cnn(width: int = 64, norm: str = "batch") -> tuple[nn.Module, int]:
    """Four conv-norm-ReLU blocks with pooling: a few million MACs per 32 px image."""
    layers: list[nn.Module] = []
    channels = 3
    for out in (width, width * 2, width * 4, width * 4):
        layers += [nn.Conv2d(channels, out, 3, padding=1, bias=False), norm_layer(norm)(out),
                   nn.ReLU(inplace=True), nn.MaxPool2d(2)]
        channels = out
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten()]
    return nn.Sequential(*layers), channels


def resnet(name: str, small_stem: bool, norm: str = "batch") -> tuple[nn.Module, int]:
    net = getattr(torchvision.models, name)(weights=None, norm_layer=norm_layer(norm))
    if small_stem:
        net.conv1 = nn.Conv2d(3, 64, 3, stride=1, padding=1, bias=False)
        net.maxpool = nn.Identity()
    features = net.fc.in_features
    net.fc = nn.Identity()
    return net, features


def projector(features: int, cfg: ModelConfig) -> nn.Sequential:
    """Linear - norm - ReLU - linear to ``projector_dim``, then (``projector_bn_out``) a
    batch norm without affine parameters and the last linear without bias, as SimCLR's
    head: every output dimension is centred over the batch, so the embeddings cannot all
    move to one point (``docs/learning.md``, "Why SupCon collapsed")."""
    hidden = cfg.projector_hidden
    layers = [nn.Linear(features, hidden, bias=False),
              nn.BatchNorm1d(hidden) if cfg.norm == "batch" else nn.GroupNorm(8, hidden),
              nn.ReLU(inplace=True), nn.Linear(hidden, cfg.projector_dim,
                                               bias=not cfg.projector_bn_out)]
    if cfg.projector_bn_out:
        layers.append(nn.BatchNorm1d(cfg.projector_dim, affine=False))
    return nn.Sequential(*layers)


class Encoder(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.backbone == "small_cnn":
            self.backbone, features = small_cnn(cfg.width, cfg.norm)
        else:
            self.backbone, features = resnet(cfg.backbone, cfg.small_stem, cfg.norm)
        self.feature_dim, self.embedding_dim = features, cfg.projector_dim
        self.projector = projector(features, cfg)

    def forward(self, images: Tensor) -> tuple[Tensor, Tensor]:
        """images [B, 3, H, W] -> (features [B, F], projections [B, P])."""
        features = self.backbone(images)
        return features, self.projector(features)


class ModelOutput(NamedTuple):
    """features [B, F], projections [B, P], text [B, P] (clip), learnable temperature []."""

    features: Tensor
    projections: Tensor
    text: Tensor | None
    temperature: Tensor | None


class ContrastiveModel(nn.Module):
    """Everything the engine trains: the encoder, CLIP's text tower when the objective
    needs one, and a learnable temperature (stored as log tau) when asked for. The
    temperature comes out of ``forward`` so wrappers (DDP) see it used there."""

    def __init__(self, cfg: ModelConfig, with_text: bool = False,
                 learnable_temperature: float | None = None) -> None:
        super().__init__()
        self.encoder = Encoder(cfg)
        self.split_views = cfg.split_views
        self.text = TextTower(cfg.text, cfg.projector_dim) if with_text else None
        self.log_temperature = None
        if learnable_temperature is not None:
            # shape [1], not [] (DeepSpeed cannot flatten 0-dim parameters)
            self.log_temperature = nn.Parameter(torch.tensor([learnable_temperature]).log())

    def forward(self, images: Tensor, input_ids: Tensor | None = None,
                attention_mask: Tensor | None = None) -> ModelOutput:
        if self.split_views and self.training:
            # [2B] = first views then second views; each half is its own batch for the
            # norms, so a view's statistics do not carry its partner's
            halves = [self.encoder(half) for half in images.chunk(2)]
            features = torch.cat([h[0] for h in halves])
            projections = torch.cat([h[1] for h in halves])
        else:
            features, projections = self.encoder(images)
        text = None if self.text is None else self.text(input_ids, attention_mask)
        temperature = (None if self.log_temperature is None
                       else self.log_temperature.exp().squeeze(0))
        return ModelOutput(features, projections, text, temperature)


def build_model(cfg: ModelConfig, objective: ObjectiveConfig,
                device: torch.device) -> ContrastiveModel:
    """The model a run trains: the encoder, plus the text tower for ``clip`` and a
    learnable temperature (initialised at ``objective.temperature``) when asked for."""
    temperature = objective.temperature if objective.learnable_temperature else None
    model = ContrastiveModel(cfg, objective_spec(objective.name).text_tower, temperature).to(device)
    if device.type == "cuda":
        if cfg.channels_last:
            model.encoder = model.encoder.to(memory_format=torch.channels_last)
        if cfg.sync_batchnorm and cfg.norm == "batch":
            model.encoder = nn.SyncBatchNorm.convert_sync_batchnorm(model.encoder)
    return model


def _part(model_state: dict[str, Tensor], prefix: str) -> dict[str, Tensor]:
    return {key[len(prefix):]: value for key, value in model_state.items()
            if key.startswith(prefix)}


def encoder_from_state(cfg: ModelConfig, model_state: dict[str, Tensor]) -> Encoder:
    """The encoder of a trained :class:`ContrastiveModel`, from that model's state dict
    (text tower and temperature, if any, are left out)."""
    encoder = Encoder(cfg)
    encoder.load_state_dict(_part(model_state, "encoder."))
    return encoder


def text_tower_from_state(cfg: ModelConfig, model_state: dict[str, Tensor]) -> TextTower | None:
    """CLIP's text tower of a trained :class:`ContrastiveModel` (None if it has none)."""
    state = _part(model_state, "text.")
    if not state:
        return None
    tower = TextTower(cfg.text, cfg.projector_dim)
    tower.load_state_dict(state)
    return tower
