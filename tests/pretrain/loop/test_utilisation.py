"""``train/tflops`` and ``train/mfu``: the encoder's FLOPs per view counted on the meta
device equal the count on real tensors and ResNet-50's published cost; the peak table
names the device; the metrics follow from the views per second."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from pretrain.loop.utilisation import Utilisation, peak_tflops
from pretrain.model.encoder import Encoder, ModelConfig
from pretrain.model.flops import encoder_flops_per_view


def test_the_meta_count_equals_the_count_on_real_tensors():
    cfg = ModelConfig(backbone="small_cnn", width=8, image_size=24)
    torch.manual_seed(0)
    encoder = Encoder(cfg)
    with FlopCounterMode(display=False) as counter:
        _, projections = encoder(torch.randn(3, 3, 24, 24))
        projections.sum().backward()
    assert encoder_flops_per_view(cfg) == counter.get_total_flops() / 3


def test_resnet50_costs_what_its_paper_says():
    """ResNet-50 at 224 px: 4.09 G multiply-adds forward (He et al. 2016, Table 1, as
    torchvision counts it); the backward costs twice the forward: 3 x 2 x 4.09 GFLOP."""
    cfg = ModelConfig(backbone="resnet50", small_stem=False, image_size=224)
    projector = 2 * 3 * (2048 * 2048 + 2048 * 128)  # the 2-layer projector's matmuls
    assert encoder_flops_per_view(cfg) == pytest.approx(3 * 2 * 4.09e9 + projector, rel=0.02)


@pytest.mark.parametrize(("name", "precision", "tf32", "peak"), [
    ("NVIDIA H100 80GB HBM3", "bf16", False, 989.4),
    ("NVIDIA H100 PCIe", "bf16", False, 756.0),
    ("NVIDIA H200", "bf16", False, 989.4),
    ("NVIDIA A100-SXM4-80GB", "fp32", True, 156.0),
    ("NVIDIA A100-SXM4-80GB", "fp32", False, 19.5),
    ("NVIDIA L40S", "bf16", False, 362.1),
    ("Quadro RTX 4000", "bf16", False, None),
])
def test_the_peak_is_looked_up_by_the_device_name(name, precision, tf32, peak):
    assert peak_tflops(name, precision, tf32) == peak


def test_tflops_and_mfu_follow_from_the_views_per_second():
    assert Utilisation(2e9).metrics(500.0) == {"train/tflops": 1.0}  # no peak: no MFU
    row = Utilisation(2e9, peak_tflops=8 * 989.4).metrics(4e5)
    assert row["train/tflops"] == pytest.approx(800.0)
    assert row["train/mfu"] == pytest.approx(800.0 / (8 * 989.4))
