"""What every engine of the table (``engine.py``) is.

An engine owns the wrapped model and the optimiser and offers ``forward`` (``engine(...)``),
``backward(loss)``, ``step()`` (clip, update, zero the gradients), ``skip(loss)`` (drop a
step whose loss is not finite), ``set_lr(factor)``, and
``state_dict()``/``load_state_dict()`` in a form ``torch.load(weights_only=True)`` reads.
All average gradients over ranks, which with the gathering boundary's scaling gives the
gradient of the global-batch loss; shared scalars such as a learnable temperature are
averaged once, like every other parameter.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from pretrain.run.sharded import AsyncWriter, load_sharded, save_sharded


class Engine:
    """Shared parts; subclasses set ``wrapped`` and ``optimizer``."""

    optimizer_sharded = False  # True when each rank holds only its share of the state
    # True when no rank holds the whole model (FSDP2): every forward gathers parameters,
    # a collective every rank must join, and the whole model exists only in checkpoints
    shards_parameters = False
    skips_on_device = False  # step(skip=...) decides on the device, no host synchronisation

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.module = model
        self.optimizer = optimizer
        self.wrapped: nn.Module = model
        self.base_lrs = [group["lr"] for group in optimizer.param_groups]
        self.async_writer: AsyncWriter | None = None  # made on the first async save

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.wrapped(*args, **kwargs)

    def accumulating(self, last: bool) -> contextlib.AbstractContextManager:
        """Around one of several backward passes of a step: gradients are reduced across
        ranks only after the ``last`` one."""
        return contextlib.nullcontext()

    def whole_root(self) -> contextlib.AbstractContextManager:
        """Around a forward of a part of the model outside its own forward (the kNN
        monitor runs the encoder): the root's parameters whole on every rank."""
        return contextlib.nullcontext()

    def set_lr(self, factor: float) -> float:
        for group, base in zip(self.optimizer.param_groups, self.base_lrs, strict=True):
            group["lr"] = base * factor
        return self.base_lrs[0] * factor

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.module.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        match_parameter_layouts(self.optimizer)

    def save_sharded(self, directory: Path) -> None:
        """``checkpoint.format=sharded``: the model and optimiser state written by every
        rank into ``directory`` (``pretrain/run/sharded.py``; a collective)."""
        save_sharded(self.module, self.optimizer, directory)

    def save_sharded_async(self, directory: Path) -> Future:
        """:meth:`save_sharded` in the background (``checkpoint.async_save``): returns once
        the state is copied; the future completes when every rank's files are written."""
        if self.async_writer is None:
            self.async_writer = AsyncWriter()
        return self.async_writer(self.module, self.optimizer, directory)

    def load_sharded(self, directory: Path) -> None:
        """Read what :meth:`save_sharded` wrote, by any engine that has it, on any number of
        ranks."""
        load_sharded(self.module, self.optimizer, directory)
        match_parameter_layouts(self.optimizer)


def match_parameter_layouts(optimizer: torch.optim.Optimizer) -> None:
    """Give each loaded state tensor its parameter's memory layout: a checkpoint written
    by FSDP2 holds contiguous tensors, a channels-last convolution weight wants its moments
    channels-last too (torch's fused optimisers refuse mismatched strides)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            for key, value in state.items():
                if isinstance(value, Tensor) and value.shape == p.shape and \
                        value.stride() != p.stride():
                    state[key] = torch.empty_like(p, dtype=value.dtype).copy_(value)


def step_unless(optimizer: torch.optim.Optimizer, skip: Tensor) -> None:
    """``optimizer.step()``, leaving weights and state untouched where ``skip`` [] (bool,
    on the device) is true: no host synchronisation (torch's fused optimisers and
    :class:`LARS` read ``found_inf``, as under a GradScaler)."""
    if isinstance(optimizer, torch.optim.SGD):  # a skipped first step must leave zeros
        for group in optimizer.param_groups:
            for p in group["params"]:
                if group["momentum"] and "momentum_buffer" not in optimizer.state[p]:
                    optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p)
    optimizer.found_inf = skip.float().reshape(())
    try:
        optimizer.step()
    finally:
        optimizer.found_inf = None
