"""The encoder's floating-point operations per view, counted once at the start of a run
by torch's flop counter (``torch.utils.flop_counter``: matrix products and convolutions)
over a forward and backward of the encoder built on the meta device, so nothing is
allocated or computed. Counted as model FLOPs: the encoder as configured, without the
recomputation of activation checkpointing or of cached-gradient chunks, and without a text
tower. Convolutions and matrix products are kept apart: in float32 a GPU may run one
through TF32 tensor cores and not the other (``torch.backends.cudnn.allow_tf32`` is on by
default, ``torch.backends.cuda.matmul.allow_tf32`` off)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.flop_counter import FlopCounterMode

from pretrain.model.encoder import Encoder, ModelConfig

VIEWS = 2  # counted on a batch of two views (batch norm needs more than one)


@dataclass(frozen=True)
class Flops:
    """FLOPs of one view, forward and backward, by the kind of kernel that runs them."""

    convolution: float
    matmul: float  # matrix products: linear layers, attention

    @property
    def total(self) -> float:
        return self.convolution + self.matmul

    @classmethod
    def counted(cls, counter: FlopCounterMode, views: int) -> Flops:
        """The counts ``counter`` recorded over ``views`` views, per view."""
        by_op = counter.get_flop_counts().get("Global", {})
        convolution = sum(n for op, n in by_op.items() if "convolution" in str(op))
        return cls(convolution / views, (counter.get_total_flops() - convolution) / views)


def encoder_flops(cfg: ModelConfig) -> Flops:
    """FLOPs of one view through the encoder (backbone and projector), forward and
    backward."""
    with torch.device("meta"):
        encoder = Encoder(cfg)
    images = torch.empty(VIEWS, 3, cfg.image_size, cfg.image_size, device="meta")
    with FlopCounterMode(display=False) as counter:
        _, projections = encoder(images)
        projections.sum().backward()
    return Flops.counted(counter, VIEWS)


def encoder_flops_per_view(cfg: ModelConfig) -> float:
    """:func:`encoder_flops` in all."""
    return encoder_flops(cfg).total
