"""``train.compile``: the encoder compiled by ``torch.compile`` (inductor, on this CPU)
gives the eager step's loss and gradients, and keeps the parameter names that
checkpoints and the registry use; so does a ViT with every block checkpointed
(``model.activation_checkpointing=full``) against the eager unchecked one.

Tolerance: float32, and the compiled kernels fuse and reorder the convolutions' and batch
norms' sums, so results differ by rounding only: measured here 4.8e-7 in the loss (of
4.46) and at most 7e-6 of a gradient's norm (the ViT: 0 and 7.1e-6). The bounds asserted,
1e-5 relative in the loss and 1e-4 of each gradient's norm, sit about 90 and 14 times above
that and far below any real difference (a missing term changes a gradient by its own size)."""

from __future__ import annotations

import dataclasses

import torch

from pretrain.distributed.fsdp2 import clean_name
from pretrain.loop.step import Objective
from pretrain.loop.trainer import forward_loss
from pretrain.model.encoder import ModelConfig, build_model
from pretrain.objectives import ObjectiveConfig

SMALL_CNN = ModelConfig(width=8, projector_hidden=32, projector_dim=16)
VIT = ModelConfig(backbone="timm:vit_tiny_patch16_224", image_size=16, patch_size=8,
                  timm_kwargs={"depth": 2, "embed_dim": 32, "num_heads": 2},
                  projector_hidden=32, projector_dim=16)


def step(compiled: bool, model_cfg: ModelConfig = SMALL_CNN,
         ) -> tuple[torch.Tensor, dict[str, torch.Tensor], list[str]]:
    torch.manual_seed(0)
    cfg = ObjectiveConfig(name="supcon", temperature=0.2)
    model = build_model(model_cfg, cfg, torch.device("cpu"))
    if compiled:
        model.encoder.compile()
    gen = torch.Generator().manual_seed(1)
    batch = {"images": torch.randn(32, 3, 16, 16, generator=gen),
             "ids": torch.arange(16).repeat(2), "labels": torch.arange(32) % 4}
    out = forward_loss(model, batch, Objective(cfg), 0)
    out.loss.backward()
    grads = {clean_name(name): p.grad for name, p in model.named_parameters()
             if p.grad is not None}  # by state-dict name: checkpointing wraps blocks
    return out.loss.detach(), grads, list(model.state_dict())


def test_a_compiled_encoder_gives_the_eager_loss_and_gradients():
    assert_same_step(step(compiled=False), step(compiled=True))


def test_a_compiled_checkpointed_vit_gives_the_eager_unchecked_step():
    """Every block checkpointed (recomputed in the backward) and compiled."""
    checkpointed = dataclasses.replace(VIT, activation_checkpointing="full")
    assert_same_step(step(False, VIT), step(True, checkpointed))


def assert_same_step(eager: tuple, compiled: tuple) -> None:
    (eager_loss, eager_grads, eager_keys), (loss, grads, keys) = eager, compiled
    assert keys == eager_keys  # checkpoints and registered weights read the same names
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=0)
    assert grads.keys() == eager_grads.keys()
    # a gradient zero in exact arithmetic (a ViT's final norm bias, which the projector's
    # batch norm cancels: ~1e-7, rounding) is held to the whole gradient's scale instead
    floor = 1e-3 * torch.stack([g.norm() for g in eager_grads.values()]).norm()
    for name, grad in grads.items():
        error = (grad - eager_grads[name]).norm() / torch.maximum(eager_grads[name].norm(),
                                                                  floor)
        assert error < 1e-4, name
