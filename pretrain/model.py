"""The encoder: a backbone plus the 2-layer projector to 128 dimensions (SimCLR, X-CLR).

Backbones: torchvision ResNet-18 / ResNet-50 (``small_stem`` replaces the 7x7/2 stem and
max-pool by a 3x3/1 convolution for 32 px images, as SINCERE's CIFAR runs), and a small CNN
for fast CPU runs. ``Encoder.forward`` returns (features [B, F], projections [B, P]); the
objectives normalise the projections, evaluation uses the features.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torchvision
from torch import Tensor, nn

from pretrain.config import InvalidValue


@dataclass
class ModelConfig:
    """``model.*``: the backbone and the projector."""

    backbone: Literal["small_cnn", "resnet18", "resnet50"] = "small_cnn"
    small_stem: bool = True  # 3x3/1 stem without max-pool, for 32-64 px images
    projector_hidden: int = 512
    projector_dim: int = 128
    channels_last: bool = True  # on GPU

    def validate(self) -> None:
        for key in ("projector_hidden", "projector_dim"):
            if getattr(self, key) < 1:
                raise InvalidValue(key, f"must be >= 1, got {getattr(self, key)}")


def small_cnn(width: int = 64) -> tuple[nn.Module, int]:
    """Four conv-BN-ReLU blocks with pooling: a few million MACs per 32 px image."""
    layers: list[nn.Module] = []
    channels = 3
    for out in (width, width * 2, width * 4, width * 4):
        layers += [nn.Conv2d(channels, out, 3, padding=1, bias=False), nn.BatchNorm2d(out),
                   nn.ReLU(inplace=True), nn.MaxPool2d(2)]
        channels = out
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten()]
    return nn.Sequential(*layers), channels


def resnet(name: str, small_stem: bool) -> tuple[nn.Module, int]:
    net = getattr(torchvision.models, name)(weights=None)
    if small_stem:
        net.conv1 = nn.Conv2d(3, 64, 3, stride=1, padding=1, bias=False)
        net.maxpool = nn.Identity()
    features = net.fc.in_features
    net.fc = nn.Identity()
    return net, features


class Encoder(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.backbone == "small_cnn":
            self.backbone, features = small_cnn()
        else:
            self.backbone, features = resnet(cfg.backbone, cfg.small_stem)
        self.feature_dim = features
        self.projector = nn.Sequential(
            nn.Linear(features, cfg.projector_hidden, bias=False),
            nn.BatchNorm1d(cfg.projector_hidden), nn.ReLU(inplace=True),
            nn.Linear(cfg.projector_hidden, cfg.projector_dim))

    def forward(self, images: Tensor) -> tuple[Tensor, Tensor]:
        """images [B, 3, H, W] -> (features [B, F], projections [B, P])."""
        features = self.backbone(images)
        return features, self.projector(features)


def build_encoder(cfg: ModelConfig, device: torch.device) -> Encoder:
    model = Encoder(cfg).to(device)
    if cfg.channels_last and device.type == "cuda":
        model = model.to(memory_format=torch.channels_last)
    return model
