"""``train/tflops`` and ``train/mfu``: the encoder's FLOPs per view counted on the meta
device equal the count on real tensors, a count by hand of the small CNN's layers and
ResNet-50's published cost; the peak is looked up by the exact device name; the run's MFU
(``app.pretrain.utilisation_of``, the object the trainer logs from) equals a hand count
on named devices, precisions, TF32 settings and world sizes."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from app.pretrain import utilisation_of
from app.run_config import RunConfig
from core.runtime import Runtime
from pretrain.loop.utilisation import PEAK_TFLOPS, KernelPaths, Utilisation, peak_tflops
from pretrain.model.encoder import Encoder, ModelConfig
from pretrain.model.flops import Flops, encoder_flops, encoder_flops_per_view


def small_cnn_flops_by_hand(width: int, size: int, hidden: int, out: int) -> Flops:
    """Four 3x3 convolutions (3 -> w -> 2w -> 4w -> 4w), each followed by a 2x2 max-pool,
    then the projector's two linear layers (4w -> hidden -> out). A forward costs 2 FLOPs
    a multiply-add; the backward computes the weights' gradient (as much again) and the
    input's gradient (as much again) except for the first convolution, whose input is the
    image."""
    channels = [3, width, 2 * width, 4 * width, 4 * width]
    macs = [(size >> i) ** 2 * 9 * channels[i] * channels[i + 1] for i in range(4)]
    convolution = 2 * (2 * macs[0] + 3 * sum(macs[1:]))
    matmul = 2 * 3 * (4 * width * hidden + hidden * out)
    return Flops(convolution=float(convolution), matmul=float(matmul))


def test_the_meta_count_equals_the_count_on_real_tensors_and_by_hand():
    cfg = ModelConfig(backbone="small_cnn", width=8, image_size=24)
    torch.manual_seed(0)
    encoder = Encoder(cfg)
    with FlopCounterMode(display=False) as counter:
        _, projections = encoder(torch.randn(3, 3, 24, 24))
        projections.sum().backward()
    assert encoder_flops(cfg) == Flops.counted(counter, views=3)
    assert encoder_flops_per_view(cfg) == counter.get_total_flops() / 3
    assert encoder_flops(cfg) == small_cnn_flops_by_hand(8, 24, 512, 128)


def test_resnet50_costs_what_its_paper_says():
    """ResNet-50 at 224 px: 4.09 G multiply-adds forward (He et al. 2016, Table 1, as
    torchvision counts it); the backward costs twice the forward: 3 x 2 x 4.09 GFLOP."""
    cfg = ModelConfig(backbone="resnet50", small_stem=False, image_size=224)
    projector = 2 * 3 * (2048 * 2048 + 2048 * 128)  # the 2-layer projector's matmuls
    assert encoder_flops_per_view(cfg) == pytest.approx(3 * 2 * 4.09e9 + projector, rel=0.02)


ALL_CONV = Flops(convolution=1.0, matmul=0.0)
TF32 = KernelPaths(tf32_convolution=True, tf32_matmul=True)
FP32 = KernelPaths(tf32_convolution=False, tf32_matmul=False)


@pytest.mark.parametrize(("name", "precision", "paths", "peak"), [
    ("NVIDIA H100 80GB HBM3", "bf16", FP32, 989.4),  # SXM
    ("NVIDIA H100 PCIe", "bf16", FP32, 756.0),
    ("NVIDIA H100 NVL", "bf16", FP32, 835.5),  # not the SXM peak it contains
    ("NVIDIA H200", "bf16", FP32, 989.4),
    ("NVIDIA H200 NVL", "bf16", FP32, 835.5),
    ("NVIDIA GH200 480GB", "bf16", FP32, 989.4),  # not shadowed by "H200"
    ("NVIDIA A100-SXM4-80GB", "fp32", TF32, 156.0),
    ("NVIDIA A100-SXM4-40GB", "fp32", FP32, 19.5),
    ("NVIDIA A100 80GB PCIe", "fp32", TF32, 156.0),
    ("NVIDIA L40", "bf16", FP32, 181.05),  # not the L4's peak
    ("NVIDIA L40S", "bf16", FP32, 362.05),
    ("NVIDIA L4", "fp32", TF32, 60.0),
    ("Quadro RTX 4000", "bf16", FP32, None),
    ("NVIDIA H100", "bf16", FP32, None),  # a prefix of a name is not a name
])
def test_the_peak_is_looked_up_by_the_exact_device_name(name, precision, paths, peak):
    assert peak_tflops(name, precision, ALL_CONV, paths) == peak


def test_every_listed_device_is_a_tensor_core_part_with_ordered_peaks():
    """A data-sheet typo (a sparse figure, a swapped column) breaks this order."""
    for name, peak in PEAK_TFLOPS.items():
        assert name.startswith("NVIDIA ") and peak.bf16 > peak.tf32 > 0 and peak.fp32 > 0
        assert 1.9 < peak.bf16 / peak.tf32 < 2.1, name  # a tensor core's bf16 is 2x TF32


def test_float32_counts_each_kind_of_kernel_at_its_own_peak():
    """cuDNN's default: convolutions through TF32, matrix products in plain float32. Two
    seconds' worth at the TF32 peak and one at the float32 peak: 2 * 494.7 + 66.9 TFLOP in
    3 s."""
    flops = Flops(convolution=2 * 494.7, matmul=1 * 66.9)
    mixed = KernelPaths(tf32_convolution=True, tf32_matmul=False)
    assert peak_tflops("NVIDIA H100 80GB HBM3", "fp32", flops, mixed) == \
        pytest.approx((2 * 494.7 + 66.9) / 3)


@pytest.fixture
def tf32_flags():
    """Sets cuDNN's and matmul's TF32 flags for the test, then puts them back."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32

    def set_flags(convolution: bool, matmul: bool) -> None:
        torch.backends.cudnn.allow_tf32 = convolution
        torch.backends.cuda.matmul.allow_tf32 = matmul
    yield set_flags
    set_flags(*saved)


@pytest.mark.parametrize("world", [1, 2, 8])
@pytest.mark.parametrize(("name", "precision", "conv_tf32", "matmul_tf32", "peak"), [
    ("NVIDIA H100 80GB HBM3", "bf16", True, False, (989.4, 989.4)),
    ("NVIDIA H100 80GB HBM3", "fp32", True, False, (494.7, 66.9)),  # torch's defaults
    ("NVIDIA A100-SXM4-80GB", "fp32", False, False, (19.5, 19.5)),
    ("NVIDIA L4", "fp32", True, True, (60.0, 60.0)),
    ("NVIDIA H200 NVL", "bf16", False, False, (835.5, 835.5)),
])
def test_the_runs_mfu_equals_a_hand_count(monkeypatch, tf32_flags, world, name, precision,
                                          conv_tf32, matmul_tf32, peak):
    """The small CNN at 32 px, 10,000 views a second over ``world`` devices: MFU is the
    time its FLOPs take at the device's peaks, per kind of kernel, over the wall time of
    all the devices."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    tf32_flags(conv_tf32, matmul_tf32)
    config = RunConfig(model=ModelConfig(backbone="small_cnn", width=64, image_size=32))
    rt = Runtime(rank=1, world=world, local_rank=0, device=torch.device("cuda", 0))
    row = utilisation_of(config, rt, precision).metrics(views_per_s=10_000.0)

    flops = small_cnn_flops_by_hand(64, 32, 512, 128)
    seconds_at_peak = 10_000 * (flops.convolution / (peak[0] * 1e12)
                                + flops.matmul / (peak[1] * 1e12))
    assert row["train/tflops"] == pytest.approx(10_000 * flops.total / 1e12, rel=1e-12)
    assert row["train/mfu"] == pytest.approx(seconds_at_peak / world, rel=1e-12)


def test_a_cpu_run_has_no_mfu():
    rt = Runtime(rank=0, world=2, local_rank=0, device=torch.device("cpu"))
    config = RunConfig(model=ModelConfig(image_size=32))
    row = utilisation_of(config, rt, "fp32").metrics(views_per_s=100.0)
    assert set(row) == {"train/tflops"}


def test_tflops_and_mfu_follow_from_the_views_per_second():
    assert Utilisation(2e9).metrics(500.0) == {"train/tflops": 1.0}  # no peak: no MFU
    row = Utilisation(2e9, peak_tflops=8 * 989.4).metrics(4e5)
    assert row["train/tflops"] == pytest.approx(800.0)
    assert row["train/mfu"] == pytest.approx(800.0 / (8 * 989.4))
