"""Encoder backbones and projector shapes."""

from __future__ import annotations

import pytest
import torch

from pretrain.model.encoder import Encoder, ModelConfig, build_model
from pretrain.objectives import ObjectiveConfig


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


def test_split_views_normalise_each_view_set_on_its_own():
    """``split_views``: in training the first and the second views are two batches for the
    norms (each half equals the encoder run on that half alone); in eval nothing changes."""
    torch.manual_seed(0)
    cfg = ModelConfig(width=8, projector_hidden=32, projector_dim=16, split_views=True)
    model = build_model(cfg, ObjectiveConfig(), torch.device("cpu"))
    images = torch.randn(12, 3, 16, 16)
    out = model(images)
    first, second = (model.encoder(half) for half in images.chunk(2))
    torch.testing.assert_close(out.projections, torch.cat([first[1], second[1]]))
    torch.testing.assert_close(out.features, torch.cat([first[0], second[0]]))
    assert not torch.allclose(out.projections, model.encoder(images)[1], atol=1e-3)
    model.eval()
    torch.testing.assert_close(model(images).projections, model.encoder(images)[1])


def test_the_objective_s_loss_parameters_are_model_parameters_without_decay():
    """SigLIP's bias: owned by the model at objective.siglip.bias, handed out by forward, learned
    without weight decay beside the learnable temperature; other objectives own none."""
    from pretrain.loop.optim import parameter_groups

    cfg = ModelConfig(width=8, projector_hidden=16, projector_dim=8)
    objective = ObjectiveConfig.of("siglip", bias=-7.0, learnable_temperature=True)
    model = build_model(cfg, objective, torch.device("cpu"))
    assert model.text is not None
    assert model.state_dict()["loss_parameters.bias"].tolist() == [-7.0]
    out = model(torch.randn(4, 3, 16, 16), torch.zeros(4, 5, dtype=torch.long),
                torch.ones(4, 5, dtype=torch.long))
    assert list(out.loss_parameters) == ["bias"] and out.loss_parameters["bias"].shape == ()
    decay, plain = parameter_groups(model, weight_decay=0.1)
    assert any(p is model.loss_parameters["bias"] for p in plain["params"])
    assert not any(p is model.loss_parameters["bias"] for p in decay["params"])
    plain_model = build_model(cfg, ObjectiveConfig(name="infonce"), torch.device("cpu"))
    assert not any(k.startswith("loss_parameters") for k in plain_model.state_dict())
