"""LARS against a hand-written update, parameter grouping, the warmup-cosine schedule."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from app.run_config import RunConfig
from core.config import ConfigError, load_config
from pretrain.loop.optim import (
    LARS,
    OptimConfig,
    build_optimizer,
    parameter_groups,
    warmup_cosine,
    warmup_cosine_in_samples,
)
from pretrain.objectives import ObjectiveConfig


def naive_lars_step(params, grads, velocities, lr, momentum, wd, eta, adapt):
    out = []
    for w, g, v, a in zip(params, grads, velocities, adapt, strict=True):
        d = g + wd * w if a else g.clone()
        if a and w.norm() > 0 and d.norm() > 0:
            d = d * (eta * w.norm() / d.norm())
        v = momentum * v + lr * d
        out.append((w - v, v))
    return out


def test_lars_matches_the_update_rule_over_three_steps():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4), nn.Linear(4, 3))
    opt = LARS(parameter_groups(model, 1e-4), lr=0.5, momentum=0.9, trust_coefficient=0.01)
    params = [p.detach().clone() for p in model.parameters()]
    adapt = [p.ndim >= 2 for p in model.parameters()]
    velocities = [torch.zeros_like(p) for p in params]
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(8, 5)).square().mean().backward()
        grads = [p.grad.detach().clone() for p in model.parameters()]
        expected = naive_lars_step(params, grads, velocities, 0.5, 0.9, 1e-4, 0.01, adapt)
        opt.step()
        params = [w for w, _ in expected]
        velocities = [v for _, v in expected]
        for got, want in zip(model.parameters(), params, strict=True):
            torch.testing.assert_close(got.detach(), want)


def test_biases_and_norm_weights_neither_decay_nor_adapt():
    model = nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4))
    decay, plain = parameter_groups(model, 0.1)
    assert [p.shape for p in decay["params"]] == [torch.Size([4, 5])]
    assert len(plain["params"]) == 3 and plain["weight_decay"] == 0 and not plain["adapt"]


@pytest.mark.parametrize("name", ["lars", "sgd", "adamw"])
def test_build_scales_lr_by_batch_and_takes_extra_parameters(name):
    model = nn.Linear(3, 2)
    tau = nn.Parameter(torch.tensor(0.1))
    opt = build_optimizer(model, OptimConfig(name=name, lr=0.2), global_batch=512, extra=[tau])
    assert all(math.isclose(g["lr"], 0.4) for g in opt.param_groups)
    assert any(p is tau for g in opt.param_groups if g["weight_decay"] == 0 for p in g["params"])


def test_warmup_then_cosine():
    factor = warmup_cosine(total_steps=110, warmup_steps=10)
    assert factor(0) == pytest.approx(0.1) and factor(9) == pytest.approx(1.0)
    assert factor(10) == pytest.approx(1.0)
    assert factor(60) == pytest.approx(0.5)
    assert factor(110) == pytest.approx(0.0, abs=1e-12)


def vit_model(layer_decay: float = 1.0):
    from pretrain.model.encoder import ModelConfig, build_model
    from pretrain.objectives import ObjectiveConfig

    cfg = ModelConfig(backbone="timm:test_vit", image_size=16, patch_size=4,
                      projector_hidden=16, projector_dim=8)
    return build_model(cfg, ObjectiveConfig(), torch.device("cpu"))


def test_layer_decay_scales_each_backbone_layer_and_leaves_the_heads_at_lr():
    """timm's rule for L blocks: the stem at decay^L, block i at decay^(L - 1 - i) (the
    last at lr), the projector at lr; decay and no-decay stay split as without it."""
    model = vit_model()
    depth = len(model.encoder.backbone.blocks)
    groups = parameter_groups(model, 0.05, layer_decay=0.5)
    scale = {id(p): g["lr_scale"] for g in groups for p in g["params"]}
    decayed = {id(p) for g in groups if g["adapt"] for p in g["params"]}
    names = dict(model.named_parameters())
    assert len(scale) == len(names)  # every parameter in exactly one group
    backbone = model.encoder.backbone
    assert scale[id(backbone.pos_embed)] == 0.5 ** depth
    assert scale[id(backbone.patch_embed.proj.weight)] == 0.5 ** depth
    for index, block in enumerate(backbone.blocks):
        assert scale[id(block.attn.qkv.weight)] == 0.5 ** (depth - 1 - index), index
    for name, p in names.items():
        if name.startswith("encoder.projector"):
            assert scale[id(p)] == 1.0, name
    unscaled = {id(p) for g in parameter_groups(model, 0.05) if g["adapt"] for p in g["params"]}
    assert decayed == unscaled
    assert id(backbone.pos_embed) not in decayed


@pytest.mark.parametrize("name", ["lars", "adamw"])
def test_layer_decay_sets_each_group_s_lr_and_the_schedule_keeps_the_ratios(name):
    model = vit_model()
    opt = build_optimizer(model, OptimConfig(name=name, lr=0.2, layer_decay=0.5),
                          global_batch=256)
    lrs = sorted({g["lr"] for g in opt.param_groups})
    depth = len(model.encoder.backbone.blocks)
    assert lrs == pytest.approx([0.2 * 0.5 ** k for k in range(depth, -1, -1)])
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(10, 2))
    for _ in range(4):
        opt.step()
        schedule.step()
    factor = warmup_cosine(10, 2)(4)
    assert sorted({g["lr"] for g in opt.param_groups}) == pytest.approx(
        [lr * factor for lr in lrs])


def test_without_layer_decay_the_groups_are_the_decayed_then_the_plain():
    groups = parameter_groups(vit_model(), 0.05)
    assert [(g["adapt"], g["lr_scale"]) for g in groups] == [(True, 1.0), (False, 1.0)]


def test_layer_decay_is_refused_before_any_work_without_timm_layers():
    from app.run_config import RunConfig
    from core.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="key 'optim.layer_decay'.*not small_cnn"):
        load_config(RunConfig, None, ["optim.layer_decay=0.7"])
    with pytest.raises(ConfigError, match="layer_decay"):
        load_config(RunConfig, None, ["optim.layer_decay=1.5"])
    config = load_config(RunConfig, None, ["optim.layer_decay=0.7",
                                           "model.backbone=timm:test_vit"])
    assert config.optim.layer_decay == 0.7
    with pytest.raises(ConfigError, match="needs a backbone that declares its layers"):
        parameter_groups(nn.Linear(3, 2), 0.1, layer_decay=0.7)


@pytest.mark.parametrize("name", ["lars", "adamw"])
def test_the_objective_s_parameters_train_at_their_own_lr_scale(name):
    """optim.loss_lr_scale: the learnable temperature and the loss parameters (SigLIP's
    bias, ProjNCE's class embeddings) at lr x scale, every other parameter at lr."""
    from pretrain.model.encoder import ModelConfig, build_model

    objective = ObjectiveConfig.of("projnce", projection="learned",
                                learnable_temperature=True)
    model = build_model(ModelConfig(width=8, projector_hidden=16, projector_dim=8), objective,
                        torch.device("cpu"), num_classes=5)
    opt = build_optimizer(model, OptimConfig(name=name, lr=0.2, loss_lr_scale=10.0),
                          global_batch=256)
    lr_of = {id(p): g["lr"] for g in opt.param_groups for p in g["params"]}
    for key, p in model.named_parameters():
        own = key in ("log_temperature", "loss_parameters.class_embeddings")
        assert lr_of[id(p)] == pytest.approx(2.0 if own else 0.2), key
    with pytest.raises(ConfigError, match="optim.loss_lr_scale"):
        load_config(RunConfig, None, ["optim.loss_lr_scale=0"])


def test_the_schedule_in_samples_is_the_step_schedule_at_the_runs_global_batch():
    """A run measured in samples: at a fixed global batch of 64 the multiplier after
    ``64 * k`` samples is step k's, and between steps it is one continuous curve."""
    by_step = warmup_cosine(110, 10)
    by_samples = warmup_cosine_in_samples(110 * 64, 64, 10)
    assert [by_samples(64 * k) for k in range(111)] == pytest.approx(
        [by_step(k) for k in range(111)], abs=1e-12)
    between = [by_samples(s) for s in range(64 * 20, 64 * 100)]
    assert max(abs(a - b) for a, b in zip(between, between[1:], strict=False)) < 1e-3
