"""SigLIP against a pair-by-pair loop and against open_clip's ``SigLipLoss`` (float64:
values and gradients agree to rounding), with a learnable temperature and bias."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from open_clip.loss import SigLipLoss

from pretrain.objectives import BatchRows, batch_loss
from pretrain.objectives.siglip import plain_siglip
from tests.pretrain.objectives.batches import FreshAllocations


def leaves(tau: float = 0.2, bias: float = -1.5) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.tensor(tau, dtype=torch.float64, requires_grad=True),
            torch.tensor(bias, dtype=torch.float64, requires_grad=True))


def test_siglip_equals_its_plain_form_in_every_leaf(batch):
    """Multiview rows: the other views' texts are neither positive nor negative."""
    text = batch.text.clone().requires_grad_()
    tau, bias = leaves()
    loss, _ = batch_loss("siglip", batch.z, batch.ids, text=text, temperature=tau, bias=bias)
    reference = plain_siglip(BatchRows(batch.z, batch.ids, text=text), tau, bias)
    torch.testing.assert_close(loss, reference, rtol=1e-12, atol=1e-12)
    wrt = [batch.z, text, tau, bias]
    for got, want in zip(torch.autograd.grad(loss, wrt), torch.autograd.grad(reference, wrt),
                         strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("tile_size", [None, 3])
@pytest.mark.parametrize(("tau", "bias"), [(0.1, -10.0), (0.5, 0.7)])
def test_siglip_equals_open_clip(tile_size, tau, bias):
    """One view per image, as open_clip's loss assumes: logit_scale = 1 / tau."""
    gen = torch.Generator().manual_seed(11)
    image = torch.randn(13, 8, dtype=torch.float64, generator=gen).requires_grad_()
    text = torch.randn(13, 8, dtype=torch.float64, generator=gen).requires_grad_()
    tau_leaf, bias_leaf = leaves(tau, bias)
    ours, metrics = batch_loss("siglip", image, torch.arange(13), text=text,
                               temperature=tau_leaf, bias=bias_leaf, tile_size=tile_size)
    peer = SigLipLoss()(F.normalize(image, dim=1), F.normalize(text, dim=1), 1 / tau_leaf,
                        bias_leaf)
    torch.testing.assert_close(ours, peer, rtol=1e-12, atol=1e-12)
    wrt = [image, text, tau_leaf, bias_leaf]
    for got, want in zip(torch.autograd.grad(ours, wrt), torch.autograd.grad(peer, wrt),
                         strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert metrics["bias"].item() == bias
    cosines = F.normalize(image, dim=1) @ F.normalize(text, dim=1).T
    torch.testing.assert_close(metrics["pos_sim"], cosines.diagonal().mean().detach())
    off = ~torch.eye(13, dtype=torch.bool)
    torch.testing.assert_close(metrics["neg_sim"], cosines[off].mean().detach())


def test_siglip_needs_text(batch):
    with pytest.raises(ValueError, match="siglip: needs the second modality"):
        batch_loss("siglip", batch.z, batch.ids, temperature=0.1)


def test_the_reported_bias_and_temperature_are_this_steps_values(batch):
    """The metrics hold copies: the optimiser's update of the learnable parameters (or
    FSDP2 freeing their gathered storage after the backward) leaves them as they were."""
    tau, bias = leaves()
    _, metrics = batch_loss("siglip", batch.z, batch.ids, text=batch.text.clone(),
                            temperature=tau, bias=bias)
    with torch.no_grad():
        tau.add_(1.0)
        bias.add_(1.0)
    assert float(metrics["bias"]) == -1.5 and float(metrics["temperature"]) == 0.2


def test_tiled_gradients_made_in_the_forward_follow_what_needs_one():
    """The tiled forward makes the gradients of the inputs that need one, scaled in the
    backward by whatever the loss is multiplied by; a text without gradient and a float
    bias leave only the images', and under no_grad it makes none."""
    gen = torch.Generator().manual_seed(3)
    image = torch.randn(11, 5, dtype=torch.float64, generator=gen).requires_grad_()
    text = torch.randn(11, 5, dtype=torch.float64, generator=gen)
    ids = torch.arange(11) // 2  # other views: neither positive nor negative

    def image_grad(tile_size):
        loss, _ = batch_loss("siglip", image, ids, text=text, temperature=0.2, bias=-1.0,
                             tile_size=tile_size)
        return torch.autograd.grad(3.0 * loss, image)[0]

    torch.testing.assert_close(image_grad(4), image_grad(None), rtol=1e-12, atol=1e-14)
    def allocations(grad_mode, *inputs):  # fresh [11, 5] float tensors of one call
        probe = FreshAllocations(numel=image.numel(), width=image.shape[1])
        with grad_mode, probe:
            batch_loss("siglip", inputs[0], ids, text=inputs[1], temperature=1.0, bias=-1.0,
                       tile_size=4)
        return probe.shapes.count((11, 5))

    leaves = image, text.clone().requires_grad_()  # at temperature 1 both reach the tiles
    without = allocations(torch.enable_grad(), image.detach(), text)
    assert allocations(torch.no_grad(), *leaves) == without
    assert allocations(torch.enable_grad(), *leaves) == without + 3  # two gradients, w a
