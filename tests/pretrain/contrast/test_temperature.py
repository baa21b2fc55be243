"""ESS temperature control (FlatNCE appendix C)."""

from __future__ import annotations

import math

import pytest
import torch

from pretrain.objectives import EssControlConfig, EssTemperatureController, batch_loss


def test_rule_multiplies_inverse_temperature():
    ctrl = EssTemperatureController(EssControlConfig(enabled=True, target=0.5, rate=0.01), 0.2)
    assert math.isclose(ctrl.update(ess=0.7), 1 / (5 * 1.01))  # ESS too high: sharpen
    ctrl.temperature = 0.2
    assert math.isclose(ctrl.update(ess=0.3), 1 / (5 * 0.99))  # ESS too low: flatten


def test_target_schedules():
    for schedule, mid in (("linear", 0.5), ("cosine", 0.5), ("constant", 0.8)):
        cfg = EssControlConfig(enabled=True, target=0.8, final_target=0.2, schedule=schedule)
        ctrl = EssTemperatureController(cfg, 0.1)
        if schedule == "constant":
            assert ctrl.target_at(0.5) == 0.8
            continue
        assert math.isclose(ctrl.target_at(0.0), 0.8) and math.isclose(ctrl.target_at(1.0), 0.2)
        assert math.isclose(ctrl.target_at(0.5), mid)
    cosine = EssTemperatureController(
        EssControlConfig(target=0.8, final_target=0.2, schedule="cosine"), 0.1)
    assert cosine.target_at(0.1) > 0.8 - 0.6 * 0.1  # cosine moves slower at the start


def test_closed_loop_drives_ess_to_target():
    gen = torch.Generator().manual_seed(0)
    ids = torch.arange(128).repeat_interleave(2)
    z = torch.randn(256, 16, generator=gen)
    ctrl = EssTemperatureController(EssControlConfig(enabled=True, target=0.3, rate=0.02), 1.0)
    for _ in range(400):
        _, metrics = batch_loss("flatnce", z, ids, temperature=ctrl.temperature)
        ctrl.update(float(metrics["ess"]))
    _, metrics = batch_loss("flatnce", z, ids, temperature=ctrl.temperature)
    assert abs(float(metrics["ess"]) - 0.3) < 0.03


def test_printed_rule_sign_would_run_away_from_the_target():
    """Why the controller's sign differs from Algorithm S1 as printed."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.arange(128).repeat_interleave(2)
    z = torch.randn(256, 16, generator=gen)
    beta = 1.0
    for _ in range(200):
        _, metrics = batch_loss("flatnce", z, ids, temperature=1 / beta)
        beta *= 0.98 if float(metrics["ess"]) > 0.3 else 1.02  # the printed rule
    assert float(batch_loss("flatnce", z, ids, temperature=1 / beta)[1]["ess"]) > 0.95


def test_state_round_trip_and_clamping():
    cfg = EssControlConfig(enabled=True, target=0.5, min_temperature=0.05, max_temperature=0.5)
    ctrl = EssTemperatureController(cfg, 0.05)
    for _ in range(50):
        ctrl.update(ess=1.0)  # always sharpen -> clamps at the minimum temperature
    assert ctrl.temperature == pytest.approx(0.05)
    other = EssTemperatureController(cfg, 0.3)
    other.load_state_dict(ctrl.state_dict())
    assert other.temperature == ctrl.temperature
