"""How much of the hardware a run uses: achieved TFLOP/s and model-FLOP utilisation
(MFU, Chowdhery et al. 2022, "PaLM", Appendix B: model FLOPs per second over the
devices' peak). The step metrics carry ``train/tflops`` (the encoder's FLOPs per view,
forward and backward, :mod:`pretrain.model.flops`, times the views trained per second over
all ranks) and, on a device named in :data:`PEAK_TFLOPS`, ``train/mfu``.

The peak is that of the kernels the run's FLOPs go through: bf16 tensor cores under bf16
autocast; in float32, TF32 tensor cores for the convolutions when cuDNN may use TF32 (its
default) and for the matrix products when matmul may, plain float32 otherwise. A mix is
counted at the time each part takes at its own peak: peak = FLOPs / sum(part / its peak).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pretrain.model.flops import Flops


@dataclass(frozen=True)
class Peak:
    """Dense (no sparsity) TFLOP/s of one device, from its vendor's data sheet."""

    bf16: float  # bf16 tensor cores
    tf32: float  # float32 through TF32 tensor cores
    fp32: float  # plain float32


_HOPPER_SXM = Peak(bf16=989.4, tf32=494.7, fp32=66.9)
_HOPPER_NVL = Peak(bf16=835.5, tf32=417.5, fp32=60.0)
_A100 = Peak(bf16=312.0, tf32=156.0, fp32=19.5)

# Keyed by the exact name ``torch.cuda.get_device_name`` reports; a device not listed has
# no MFU (a name that merely contains another, such as "H100 NVL" and "H100", is a
# different device with a different peak).
PEAK_TFLOPS: dict[str, Peak] = {
    "NVIDIA H100 80GB HBM3": _HOPPER_SXM,
    "NVIDIA H100 PCIe": Peak(bf16=756.0, tf32=378.0, fp32=51.2),
    "NVIDIA H100 NVL": _HOPPER_NVL,
    "NVIDIA H200": _HOPPER_SXM,
    "NVIDIA H200 NVL": _HOPPER_NVL,
    "NVIDIA GH200 480GB": _HOPPER_SXM,
    "NVIDIA GH200 144G HBM3e": _HOPPER_SXM,
    "NVIDIA B200": Peak(bf16=2250.0, tf32=1100.0, fp32=80.0),
    "NVIDIA A100-SXM4-40GB": _A100,
    "NVIDIA A100-SXM4-80GB": _A100,
    "NVIDIA A100-PCIE-40GB": _A100,
    "NVIDIA A100 80GB PCIe": _A100,
    "NVIDIA L40": Peak(bf16=181.05, tf32=90.5, fp32=90.5),
    "NVIDIA L40S": Peak(bf16=362.05, tf32=183.0, fp32=91.6),
    "NVIDIA L4": Peak(bf16=121.0, tf32=60.0, fp32=30.3),
    "NVIDIA A10": Peak(bf16=125.0, tf32=62.5, fp32=31.2),
}


@dataclass(frozen=True)
class KernelPaths:
    """Which float32 kernels may go through TF32 tensor cores."""

    tf32_convolution: bool
    tf32_matmul: bool

    @classmethod
    def of_this_process(cls) -> KernelPaths:
        return cls(torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32)


def peak_tflops(device_name: str, precision: str, flops: Flops,
                paths: KernelPaths) -> float | None:
    """The dense peak of one device named ``device_name`` for ``flops`` at the run's
    ``precision`` (``bf16``, or float32 through the kernels ``paths`` allows); None when
    the device is not in the table."""
    peak = PEAK_TFLOPS.get(device_name)
    if peak is None or flops.total <= 0:
        return None
    if precision == "bf16":
        return peak.bf16
    convolution = peak.tf32 if paths.tf32_convolution else peak.fp32
    matmul = peak.tf32 if paths.tf32_matmul else peak.fp32
    return flops.total / (flops.convolution / convolution + flops.matmul / matmul)


def device_peak_tflops(device: torch.device, precision: str, flops: Flops) -> float | None:
    """:func:`peak_tflops` of this process's device; None on a CPU."""
    if device.type != "cuda":
        return None
    return peak_tflops(torch.cuda.get_device_name(device), precision, flops,
                       KernelPaths.of_this_process())


@dataclass(frozen=True)
class Utilisation:
    """``flops_per_view`` of the encoder, and the peak TFLOP/s of all the run's devices
    together (None: unknown)."""

    flops_per_view: float
    peak_tflops: float | None = None

    def metrics(self, views_per_s: float) -> dict[str, float]:
        tflops = self.flops_per_view * views_per_s / 1e12
        row = {"train/tflops": tflops}
        if self.peak_tflops:
            row["train/mfu"] = tflops / self.peak_tflops
        return row
