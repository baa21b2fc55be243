"""The encoder's floating-point operations per view, counted once at the start of a run
by torch's flop counter (``torch.utils.flop_counter``: matrix products and convolutions)
over a forward and backward of the encoder built on the meta device, so nothing is
allocated or computed. Counted as model FLOPs: the encoder as configured, without the
recomputation of activation checkpointing or of cached-gradient chunks, and without a text
tower."""

from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode

from pretrain.model.encoder import Encoder, ModelConfig

VIEWS = 2  # counted on a batch of two views (batch norm needs more than one)


def encoder_flops_per_view(cfg: ModelConfig) -> float:
    """FLOPs of one view through the encoder (backbone and projector), forward and
    backward."""
    with torch.device("meta"):
        encoder = Encoder(cfg)
    images = torch.empty(VIEWS, 3, cfg.image_size, cfg.image_size, device="meta")
    with FlopCounterMode(display=False) as counter:
        _, projections = encoder(images)
        projections.sum().backward()
    return counter.get_total_flops() / VIEWS
