"""LARS against a hand-written update, parameter grouping, the warmup-cosine schedule."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from pretrain.optim import LARS, OptimConfig, build_optimizer, parameter_groups, warmup_cosine


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
