"""SPEC section 4's defining test through the real engines: for every objective, 2 gloo
ranks holding different, uneven rows give the loss and the gradient of every parameter
(learnable temperature included) of 1 process on the concatenated batch, under DDP and
DeepSpeed ZeRO-1 and ZeRO-2."""

from __future__ import annotations

import pytest
import torch

from pretrain.config import ConfigError, load_config
from pretrain.engine import EngineConfig
from tests.pretrain import engine_tasks

CASES = [("infonce", {}), ("supcon", {}), ("sincere", {}), ("eps_supinfonce", {}),
         ("flatnce", {}), ("holder_flatnce", {}), ("xclr", {}), ("clip", {}),
         ("projnce", {"projection": "centroid"}), ("projnce", {"projection": "kernel"}),
         ("projnce", {"projection": "median"})]
ENGINES = [("ddp", ""), ("deepspeed", "launch/deepspeed/zero1.json"),
           ("deepspeed", "launch/deepspeed/zero2.json")]


@pytest.mark.parametrize(("engine", "zero"), ENGINES, ids=["ddp", "zero1", "zero2"])
@pytest.mark.parametrize(("name", "hparams"), CASES,
                         ids=[f"{n}-{h.get('projection', '')}".rstrip("-") for n, h in CASES])
def test_two_ranks_equal_one_process(gloo2, engine, zero, name, hparams):
    ranks = gloo2.run(engine_tasks.run_step, engine, zero, name, hparams)
    whole = engine_tasks.run_step("ddp", "", name, hparams, rows=slice(None))
    loss = sum(r["loss"] for r in ranks) / len(ranks)
    torch.testing.assert_close(loss, whole["loss"], rtol=0, atol=1e-6)
    assert set(whole["grads"]) >= {"log_temperature"}
    for rank in ranks:  # the engine leaves every rank with the averaged gradient
        assert set(rank["grads"]) == set(whole["grads"])
        for key, grad in whole["grads"].items():
            torch.testing.assert_close(rank["grads"][key], grad, rtol=0, atol=1e-6, msg=key)


def test_deepspeed_config_must_set_gradient_clipping(tmp_path):
    bad = tmp_path / "zero.json"
    bad.write_text('{"zero_optimization": {"stage": 2}}')
    with pytest.raises(ConfigError, match="gradient_clipping"):
        load_config(EngineConfig, overrides=["name=deepspeed", f"deepspeed_config={bad}"])
    bad.write_text('{"zero_optimization": {"stage": 3}, "gradient_clipping": 1.0}')
    with pytest.raises(ConfigError, match="stage must be 1 or 2"):
        load_config(EngineConfig, overrides=["name=deepspeed", f"deepspeed_config={bad}"])
