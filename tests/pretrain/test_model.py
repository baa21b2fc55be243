"""Encoder backbones and projector shapes."""

from __future__ import annotations

import pytest
import torch

from pretrain.model import Encoder, ModelConfig


@pytest.mark.parametrize(("backbone", "features"), [("small_cnn", 256), ("resnet18", 512),
                                                    ("resnet50", 2048)])
def test_features_and_projections(backbone, features):
    model = Encoder(ModelConfig(backbone=backbone, projector_hidden=64, projector_dim=128))
    feats, proj = model(torch.randn(2, 3, 32, 32))
    assert feats.shape == (2, features) and proj.shape == (2, 128)
    assert model.feature_dim == features


def test_small_stem_keeps_resolution_for_small_images():
    small = Encoder(ModelConfig(backbone="resnet18", small_stem=True)).backbone
    large = Encoder(ModelConfig(backbone="resnet18", small_stem=False)).backbone
    assert small.conv1.stride == (1, 1) and isinstance(small.maxpool, torch.nn.Identity)
    assert large.conv1.stride == (2, 2)
