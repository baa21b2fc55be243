"""The table of training engines, behind one small interface: DDP (gloo on CPU, NCCL on
GPU), DeepSpeed ZeRO-1/2/3 (``deepspeed_engine.py``) and FSDP2 (parameters sharded,
``fsdp2.py``). Each entry of :data:`ENGINES` declares what the engine needs from the run
(a process group even on one rank, its own configuration check, a change to the model
before the optimiser is built) and what the run must know of it (per-rank flat optimizer
partitions); adding an engine is its class, its entry, its test and a line in
``docs/training.md``.

The interface every engine offers: ``engine_base.py``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor, nn

from core.config import InvalidValue
from core.tables import table_entry
from pretrain.distributed.deepspeed_engine import DeepSpeedEngine, read_deepspeed_config
from pretrain.distributed.engine_base import Engine, step_unless
from pretrain.distributed.fsdp2 import full_state, load_full_state, shard_model


@dataclass
class EngineConfig:
    """``engine.*``. DeepSpeed reads its JSON (``deepspeed_config``, under launch/deepspeed/),
    which must set ``gradient_clipping`` explicitly; DDP clips at ``gradient_clipping``."""

    name: str = "ddp"  # the training engine: an entry of ENGINES (ddp, deepspeed, fsdp2)
    deepspeed_config: str = "launch/deepspeed/zero1.json"  # deepspeed: its JSON config
    gradient_clipping: float = 0.0  # ddp: max global gradient norm, 0 = off
    backend: Literal["auto", "gloo", "nccl"] = "auto"  # auto: nccl on GPU, gloo on CPU
    process_group: bool = False  # ddp: a group and the DDP wrapper for one process too
    reshard_after_forward: bool = True  # fsdp2: free a block's gathered parameters after its
    # forward (gathered again for the backward); false keeps them, trading memory for traffic
    replicate: int = 1  # fsdp2: > 1 = HSDP, this many replica groups, each sharding
    # a collective's wait for a rank that stopped answering (a lost node) before the run
    # fails and torchrun restarts it on the ranks that are left
    collective_timeout: float = 600.0  # seconds

    def validate(self) -> None:
        if self.gradient_clipping < 0:
            raise InvalidValue("gradient_clipping", f"must be >= 0, got {self.gradient_clipping}")
        if self.replicate < 1:
            raise InvalidValue("replicate", f"must be >= 1, got {self.replicate}")
        if self.collective_timeout <= 0:
            raise InvalidValue("collective_timeout",
                               f"must be > 0 seconds, got {self.collective_timeout}")
        engine_spec(self.name).check(self)


class DDPEngine(Engine):
    """torch DistributedDataParallel; a plain module when there is one process."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 cfg: EngineConfig, device: torch.device) -> None:
        super().__init__(model, optimizer)
        self.clip = cfg.gradient_clipping
        if dist.is_initialized() and (dist.get_world_size() > 1 or cfg.process_group):
            ids = [device.index] if device.type == "cuda" else None
            self.wrapped = nn.parallel.DistributedDataParallel(model, device_ids=ids)

    def backward(self, loss: Tensor) -> None:
        loss.backward()

    def accumulating(self, last: bool) -> contextlib.AbstractContextManager:
        if last or self.wrapped is self.module:
            return contextlib.nullcontext()
        return self.wrapped.no_sync()

    def skip(self, loss: Tensor) -> None:
        """Drop this step's update. A DDP forward expects its backward (the reducer would
        refuse the next forward), so run it and throw the non-finite gradients away."""
        if self.wrapped is not self.module:
            loss.backward()
        self.optimizer.zero_grad(set_to_none=True)

    skips_on_device = True

    def step(self, skip: Tensor | None = None) -> None:
        """Clip, update and zero the gradients; where ``skip`` [] (bool, on the device) is
        true the update leaves weights and optimiser state untouched."""
        if self.clip > 0:
            nn.utils.clip_grad_norm_(self.module.parameters(), self.clip)
        if skip is None:
            self.optimizer.step()
        else:
            step_unless(self.optimizer, skip)
        self.optimizer.zero_grad(set_to_none=True)


class FSDP2Engine(DDPEngine):
    """DDP's step (clipping, the update masked on the device) on a model that
    ``engine.prepare`` sharded with FSDP2 (``fsdp2.py``): no wrapper (the sharded model is
    the module), gradients reduced only after the last backward of a step, full-state
    checkpoints in DDP's layout. Every forward is a collective (it gathers parameters)."""

    shards_parameters = True

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 cfg: EngineConfig) -> None:
        Engine.__init__(self, model, optimizer)
        self.clip = cfg.gradient_clipping

    @contextlib.contextmanager
    def accumulating(self, last: bool) -> Iterator[None]:
        self.module.set_requires_gradient_sync(last)
        try:
            yield
        finally:
            self.module.set_requires_gradient_sync(True)

    @contextlib.contextmanager
    def whole_root(self) -> Iterator[None]:
        """The root's parameters (stem, projector) gathered: the blocks gather their own
        in their forwards, the root's only in the whole model's forward."""
        self.module.unshard()
        try:
            yield
        finally:
            self.module.reshard()

    def skip(self, loss: Tensor) -> None:
        """Drop this step's update, after the backward FSDP2 expects of its forward."""
        loss.backward()
        self.optimizer.zero_grad(set_to_none=True)

    def state_dict(self) -> dict[str, Any]:
        return full_state(self.module, self.optimizer)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load_full_state(self.module, self.optimizer, state)


class EngineInputs(NamedTuple):
    """What an engine is built from: the model, its optimiser, ``engine.*``, the device and
    the micro-batch (images per rank and step, every view counted)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    cfg: EngineConfig
    device: torch.device
    micro_batch: int


def no_check(cfg: EngineConfig) -> None:
    """An engine with no keys of its own to check."""


def no_prepare(model: nn.Module, cfg: EngineConfig, precision: str) -> None:
    """An engine that takes the model as it is built."""


def shard_for_fsdp2(model: nn.Module, cfg: EngineConfig, precision: str) -> None:
    shard_model(model, cfg.reshard_after_forward, cfg.replicate, precision)


@dataclass(frozen=True)
class EngineSpec:
    """An engine and what it needs from the run."""

    build: Callable[[EngineInputs], Engine]
    process_group: bool = False  # needs a process group even on one rank
    # optimises flat per-rank partitions: a per-layer rule such as LARS's trust ratio sees a
    # partition, not a layer (the run warns)
    flat_partitions: bool = False
    check: Callable[[EngineConfig], None] = no_check  # its engine.* keys, before any work
    # (model, engine.*, precision): changes the model in place before the optimiser is
    # built over its parameters (FSDP2 shards them)
    prepare: Callable[[nn.Module, EngineConfig, str], None] = no_prepare
    # writes and reads checkpoint.format=sharded (a torch optimiser's state; not ZeRO's)
    sharded_checkpoints: bool = True


def deepspeed_check(cfg: EngineConfig) -> None:
    read_deepspeed_config(cfg.deepspeed_config)


def build_deepspeed(inputs: EngineInputs) -> Engine:
    return DeepSpeedEngine(inputs.model, inputs.optimizer, inputs.cfg.deepspeed_config,
                           inputs.micro_batch)


ENGINES: dict[str, EngineSpec] = {
    "ddp": EngineSpec(lambda i: DDPEngine(i.model, i.optimizer, i.cfg, i.device)),
    "deepspeed": EngineSpec(
        build_deepspeed, process_group=True, flat_partitions=True, check=deepspeed_check,
        sharded_checkpoints=False),
    "fsdp2": EngineSpec(lambda i: FSDP2Engine(i.model, i.optimizer, i.cfg),
                        process_group=True, prepare=shard_for_fsdp2),
}


def engine_spec(name: str) -> EngineSpec:
    """The entry of engine ``name``; :class:`InvalidValue` for ``engine.name``, naming the
    choices, if there is none."""
    return table_entry(ENGINES, name, "name", "engine")


def build_engine(model: nn.Module, optimizer: torch.optim.Optimizer, cfg: EngineConfig,
                 device: torch.device, micro_batch: int) -> Engine:
    """The engine ``cfg.name`` names around ``model`` and ``optimizer``."""
    return engine_spec(cfg.name).build(EngineInputs(model, optimizer, cfg, device, micro_batch))
