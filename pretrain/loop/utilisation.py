"""How much of the hardware a run uses: achieved TFLOP/s and model-FLOP utilisation
(MFU, Chowdhery et al. 2022, "PaLM", Appendix B: model FLOPs per second over the
devices' peak). The step metrics carry ``train/tflops`` (the encoder's FLOPs per view,
forward and backward, :mod:`pretrain.model.flops`, times the views trained per second over
all ranks) and, on a device whose dense peak is in :data:`PEAK_TFLOPS`, ``train/mfu``."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Dense (no sparsity) peak TFLOP/s per device, from the vendors' data sheets: bf16 tensor
# cores, fp32 through TF32 tensor cores, and plain fp32. The first name a device's name
# contains is taken, so the more specific come first.
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H100 PCIe": {"bf16": 756.0, "tf32": 378.0, "fp32": 51.2},
    "H100": {"bf16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "H200": {"bf16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "GH200": {"bf16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "B200": {"bf16": 2250.0, "tf32": 1100.0, "fp32": 80.0},
    "A100": {"bf16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "L40S": {"bf16": 362.1, "tf32": 183.0, "fp32": 91.6},
    "L4": {"bf16": 121.0, "tf32": 60.0, "fp32": 30.3},
    "A10": {"bf16": 125.0, "tf32": 62.5, "fp32": 31.2},
}


def peak_tflops(device_name: str, precision: str, tf32: bool) -> float | None:
    """The dense peak of one device named ``device_name`` at the run's ``precision``
    (``bf16``, or ``fp32``: through TF32 when ``tf32``); None when not in the table."""
    for name, peaks in PEAK_TFLOPS.items():
        if name in device_name:
            return peaks["bf16" if precision == "bf16" else "tf32" if tf32 else "fp32"]
    return None


def device_peak_tflops(device: torch.device, precision: str) -> float | None:
    """:func:`peak_tflops` of this process's device; None on a CPU."""
    if device.type != "cuda":
        return None
    return peak_tflops(torch.cuda.get_device_name(device), precision,
                       torch.backends.cuda.matmul.allow_tf32)


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
