"""``train.compile``: the encoder compiled by ``torch.compile`` (inductor, on this CPU)
gives the eager step's loss and gradients, and keeps the parameter names that
checkpoints and the registry use.

Tolerance: float32, and the compiled kernels fuse and reorder the convolutions' and batch
norms' sums, so results differ by rounding only: measured here 4.8e-7 in the loss (of
4.46) and at most 7e-6 of a gradient's norm. The bounds asserted, 1e-5 relative in the loss
and 1e-4 of each gradient's norm, sit about 90 and 14 times above that and far below any real
difference (a missing term changes a gradient by its own size).
"""

from __future__ import annotations

import torch

from pretrain.loop.step import Objective
from pretrain.loop.trainer import forward_loss
from pretrain.losses import ObjectiveConfig
from pretrain.model.encoder import ModelConfig, build_model


def step(compiled: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor], list[str]]:
    torch.manual_seed(0)
    cfg = ObjectiveConfig(name="supcon", temperature=0.2)
    model = build_model(ModelConfig(width=8, projector_hidden=32, projector_dim=16), cfg,
                        torch.device("cpu"))
    if compiled:
        model.encoder.compile()
    gen = torch.Generator().manual_seed(1)
    batch = {"images": torch.randn(32, 3, 16, 16, generator=gen),
             "ids": torch.arange(16).repeat(2), "labels": torch.arange(32) % 4}
    out = forward_loss(model, batch, Objective(cfg), 0)
    out.loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach(), grads, list(model.state_dict())


def test_a_compiled_encoder_gives_the_eager_loss_and_gradients():
    eager_loss, eager_grads, eager_keys = step(compiled=False)
    loss, grads, keys = step(compiled=True)
    assert keys == eager_keys  # checkpoints and registered weights read the same names
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=0)
    assert grads.keys() == eager_grads.keys()
    for name, grad in grads.items():
        error = (grad - eager_grads[name]).norm() / eager_grads[name].norm().clamp(min=1e-12)
        assert error < 1e-4, name
