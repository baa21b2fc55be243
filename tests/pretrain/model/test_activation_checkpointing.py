"""Activation checkpointing (``model.activation_checkpointing``) against the same model
unchecked: one step in float64 gives the same loss, the same gradient of every parameter
and the same batch-norm statistics; the state dict has the same keys and loads either way;
and the checkpointed blocks really hold less (the tensors autograd saves) and run twice."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from core.config import ConfigError, load_config
from core.errors import RunError
from pretrain.model.activation_checkpointing import check_compilable
from pretrain.model.encoder import ContrastiveModel, ModelConfig, build_model
from pretrain.objectives import ObjectiveConfig

CASES = {  # name -> model keys: every kind of block the table declares
    "small_cnn": {"backbone": "small_cnn", "width": 8},
    "resnet18": {"backbone": "resnet18"},
    "vit_hybrid": {"backbone": "timm:vit_tiny_patch16_224", "image_size": 32,
                   "patch_size": 8, "vit_stem": "hybrid", "width": 8,
                   "timm_kwargs": {"depth": 4}},
}
SETTINGS = ["full", 2]
IN_BLOCK_0 = {"small_cnn": "0", "resnet18": "layer1._checkpoint_wrapped_module.0.conv1",
              "vit_hybrid": "blocks.0._checkpoint_wrapped_module.attn.qkv"}


def model_of(keys: dict, setting, objective: str = "infonce", text=None) -> ContrastiveModel:
    cfg = ModelConfig(**keys, activation_checkpointing=setting)
    if text is not None:
        cfg = dataclasses.replace(cfg, text=dataclasses.replace(text, trainable=True))
    torch.manual_seed(0)
    return build_model(cfg, ObjectiveConfig.of(objective), torch.device("cpu")).double()


def plain_name(name: str) -> str:
    """A parameter's name as the unchecked model has it (the wrapper's hooks do the same
    for the state dict; ``named_parameters`` from above a wrapper shows it)."""
    return name.replace("_checkpoint_wrapped_module.", "")


def step(model: ContrastiveModel, images: torch.Tensor, text: bool = False):
    """One forward and backward; the loss, every gradient and every buffer."""
    model.train()
    tokens = ({"input_ids": torch.arange(16).reshape(4, 4) % 100 + 1,
               "attention_mask": torch.ones(4, 4, dtype=torch.long)} if text else {})
    out = model(images, **tokens)
    loss = out.projections.square().sum().sin() + out.features.square().mean()
    if text:
        loss = loss + out.text.square().sum().cos()
    loss.backward()
    grads = {plain_name(name): p.grad.clone() for name, p in model.named_parameters()
             if p.grad is not None}
    return loss.detach(), grads, {k: v.clone() for k, v in model.state_dict().items()}


def images() -> torch.Tensor:
    return torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(1),
                       dtype=torch.float64)


def assert_same_step(plain, checked) -> None:
    (loss_a, grads_a, state_a), (loss_b, grads_b, state_b) = plain, checked
    torch.testing.assert_close(loss_b, loss_a, rtol=1e-12, atol=0)
    assert grads_b.keys() == grads_a.keys()
    for name in grads_a:  # float64: only the order of additions may differ
        torch.testing.assert_close(grads_b[name], grads_a[name], rtol=1e-10, atol=1e-12,
                                   msg=name)
    assert state_b.keys() == state_a.keys()
    for key in state_a:  # running statistics taken once, as without checkpointing
        torch.testing.assert_close(state_b[key], state_a[key], rtol=1e-12, atol=0, msg=key)


@pytest.mark.parametrize("setting", SETTINGS, ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_a_checkpointed_step_equals_the_unchecked_one(case, setting):
    plain = step(model_of(CASES[case], "none"), images())
    checked = step(model_of(CASES[case], setting), images())
    assert_same_step(plain, checked)


@pytest.mark.parametrize("setting", SETTINGS, ids=str)
def test_the_text_tower_checkpointed_equals_the_unchecked_one(random_text, setting):
    keys = CASES["small_cnn"]
    plain = step(model_of(keys, "none", "clip", random_text), images(), text=True)
    checked = step(model_of(keys, setting, "clip", random_text), images(), text=True)
    assert_same_step(plain, checked)
    assert any(name.startswith("text.transformer") for name in checked[1])


def saved_bytes(model: nn.Module) -> int:
    """Bytes of the tensors autograd keeps for the backward of one forward."""
    total = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += tensor.numel() * tensor.element_size()
        return tensor

    model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(images())
    return total


@pytest.mark.parametrize("case", list(CASES))
def test_checkpointed_blocks_hold_less_and_run_again_in_the_backward(case):
    plain, full, every2 = (saved_bytes(model_of(CASES[case], s)) for s in ("none", "full", 2))
    assert full < every2 < plain, (plain, every2, full)
    model = model_of(CASES[case], "full")
    calls = []
    model.encoder.backbone.get_submodule(IN_BLOCK_0[case]).register_forward_hook(
        lambda *_: calls.append(1))
    step(model, images())
    assert len(calls) == 2  # the forward, then again in the backward


def test_a_checkpointed_model_loads_the_unchecked_state_and_back():
    plain, checked = model_of(CASES["resnet18"], "none"), model_of(CASES["resnet18"], 2)
    for param in plain.parameters():
        param.data.add_(1.0)
    checked.load_state_dict(plain.state_dict())
    assert ([plain_name(n) for n, _ in checked.named_parameters()]
            == [n for n, _ in plain.named_parameters()])
    plain.load_state_dict(checked.state_dict())
    for a, b in zip(plain.parameters(), checked.parameters(), strict=True):
        torch.testing.assert_close(a, b)


def test_the_setting_is_none_full_or_a_positive_k(tmp_path):
    assert load_config(ModelConfig, None, ["activation_checkpointing=3"]
                       ).activation_checkpointing == 3
    assert load_config(ModelConfig, None, ["activation_checkpointing=full"]
                       ).activation_checkpointing == "full"
    with pytest.raises(ConfigError, match="activation_checkpointing.*got 0"):
        load_config(ModelConfig, None, ["activation_checkpointing=0"])


def test_a_timm_model_without_a_block_list_takes_full_only():
    keys = {"backbone": "timm:resnet10t"}
    checked = model_of(keys, "full")
    assert checked.encoder.backbone.grad_checkpointing  # timm's own mechanism
    with pytest.raises(RunError, match="activation_checkpointing=2: timm:resnet10t has no "
                                       "list of blocks.*=full"):
        model_of(keys, 2)


@pytest.mark.parametrize("name", ["small_cnn", "resnet18", "vit_hybrid"])
def test_compiling_checkpointed_batch_norm_is_refused_in_one_line(name):
    """``train.compile`` cannot trace the context that puts batch-norm statistics back (it
    fails in the first step): refused before training, naming both keys; blocks without
    batch norm (the ViT's, beside its batch-norm stem) and unchecked models pass."""
    cfg = ModelConfig(**CASES[name], activation_checkpointing="full")
    backbone = build_model(cfg, ObjectiveConfig(), torch.device("cpu")).encoder.backbone
    if name != "vit_hybrid":
        with pytest.raises(RunError, match="train.compile=true with "
                                           "model.activation_checkpointing=full"):
            check_compilable(backbone, cfg.backbone, "full")
    else:
        check_compilable(backbone, cfg.backbone, "full")
    check_compilable(backbone, cfg.backbone, "none")
    assert any(isinstance(m, nn.BatchNorm2d) for m in backbone.modules())
