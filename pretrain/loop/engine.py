"""The table of training engines, behind one small interface: DDP (gloo on CPU, NCCL on
GPU), DeepSpeed ZeRO-1/2/3 (stage 3: ``zero3.py``) and FSDP2 (parameters sharded,
``fsdp2.py``). Each entry of :data:`ENGINES` declares what the engine needs from the run
(a process group even on one rank, its own configuration check, a change to the model
before the optimiser is built) and what the run must know of it (per-rank flat optimizer
partitions); adding an engine is its class, its entry, its test and a line in
``docs/training.md``.

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
import json
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor, nn

from core.config import InvalidValue
from core.tables import table_entry
from pretrain.loop import zero3
from pretrain.loop.fsdp2 import full_state, load_full_state, shard_model
from pretrain.loop.optim import step_unless
from pretrain.run.checkpoint import Unresumable
from pretrain.run.reshard import (
    SUB_GROUPS,
    ZERO3_STATE,
    per_parameter_state,
    zero3_partition_for,
    zero_partition_for,
    zero_stage_of,
)
from pretrain.run.sharded import AsyncWriter, load_sharded, save_sharded


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


def read_deepspeed_config(path: str) -> dict[str, Any]:
    """The DeepSpeed JSON at ``path``; it must set gradient_clipping (DeepSpeed would
    otherwise clip silently at 1.0) and a ZeRO stage of 1, 2 or 3."""
    file = Path(path)
    if not file.is_file():
        raise InvalidValue("deepspeed_config", f"{path}: no such file")
    try:
        config = json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise InvalidValue("deepspeed_config", f"{path}: not valid JSON ({err})") from err
    if "gradient_clipping" not in config:
        raise InvalidValue("deepspeed_config", f"{path}: set \"gradient_clipping\" explicitly "
                                               "(0.0 turns clipping off)")
    stage = config.get("zero_optimization", {}).get("stage", 0)
    if stage not in (1, 2, 3):
        raise InvalidValue("deepspeed_config", f"{path}: zero_optimization.stage must be 1, 2 or "
                                               f"3, got {stage}")
    return config


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


class DeepSpeedEngine(Engine):
    """DeepSpeed ZeRO stage 1, 2 or 3 around our optimiser (LARS included). Under stage 3
    every rank holds 1/N of each parameter (``zero3.py``): every forward gathers
    parameters, a collective, as under FSDP2."""

    optimizer_sharded = True
    _UNSAFE_KEYS = ("loss_scaler", "param_slice_mappings", "zero_stage")  # live objects

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 cfg: EngineConfig, micro_batch: int) -> None:
        import deepspeed

        config = read_deepspeed_config(cfg.deepspeed_config)
        config.update(train_micro_batch_size_per_gpu=micro_batch, gradient_accumulation_steps=1)
        self.stage = "3" if config["zero_optimization"]["stage"] == 3 else "1/2"  # layouts
        self.shards_parameters = self.stage == "3"
        self.round_robin = config["zero_optimization"].get("round_robin_gradients", False)
        self.ds, zero_optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, config=config, dist_init_required=False)
        super().__init__(model, zero_optimizer)
        self.wrapped = self.ds

    def backward(self, loss: Tensor) -> None:
        self.ds.backward(loss)

    @contextlib.contextmanager
    def accumulating(self, last: bool) -> Iterator[None]:
        """DeepSpeed's accumulation boundary: ZeRO-1 reduces at the boundary only; ZeRO-2
        and 3 reduce-scatter every backward into their gradient partitions (by design)."""
        self.ds.set_gradient_accumulation_boundary(last)
        try:
            yield
        finally:
            self.ds.set_gradient_accumulation_boundary(True)

    def skip(self, loss: Tensor) -> None:
        """Drop this step's update: no backward, so nothing reaches ZeRO's buffers."""

    def step(self) -> None:
        self.ds.step()

    def state_dict(self) -> dict[str, Any]:
        """The model (under ZeRO-3 gathered to rank 0, a collective) and this rank's
        optimizer partition (under ZeRO-3 with the sub-groups' parameter counts)."""
        optimizer = {k: v for k, v in self.optimizer.state_dict().items()
                     if k not in self._UNSAFE_KEYS}
        if self.stage == "3":
            optimizer[SUB_GROUPS] = zero3.sub_groups(self.optimizer)
            return {"model": zero3.gathered_model_state(self.module), "optimizer": optimizer}
        return {"model": self.module.state_dict(), "optimizer": optimizer}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """``state["optimizer"]``: this rank's partition as it saved it, or
        ``state["optimizer_partitions"]``: every partition of a checkpoint written by
        another number of ranks, resharded here (:func:`pretrain.run.reshard.zero_partition_for`;
        under ZeRO-3 joined per parameter and cut again)."""
        parts = state.get("optimizer_partitions", [state.get("optimizer")])
        written = zero_stage_of(parts[0])
        if written != self.stage:
            raise Unresumable(f"written under ZeRO stage {written} and this run has stage "
                              f"{self.stage}: resume it with stage {written} (on any number "
                              "of ranks) or with engine.name=ddp or fsdp2")
        live = self._zero3_state(state) if self.stage == "3" else self._zero_state(state)
        # ZeRO reads entry [dp_rank] of a per-rank list; this rank's own state fills it. The
        # fp32 master weights come from the checkpoint, not from the (possibly bf16) model.
        self.optimizer.load_state_dict([live] * dist.get_world_size(),
                                       load_from_fp32_weights=True)

    def _zero_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """ZeRO-1/2: the model loaded; this rank's optimizer state, as ZeRO reads it."""
        self.module.load_state_dict(state["model"])
        live = self.optimizer.state_dict()
        if "optimizer_partitions" in state:
            return zero_partition_for(state["optimizer_partitions"], live, dist.get_rank(),
                                      dist.get_world_size(), self.round_robin)
        return {**live, **state["optimizer"]}

    def _zero3_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """ZeRO-3: the model loaded module by module and the fp32 partitions refreshed from
        it; this rank's optimizer state, its own, or cut from the partitions of another
        number of ranks joined per parameter."""
        zero3.load_model_state(self.module, state["model"])
        self.optimizer.refresh_fp32_params()
        live = self.optimizer.state_dict()
        if "optimizer_partitions" not in state:
            return {**live, **state["optimizer"]}
        per_parameter = per_parameter_state(state["optimizer_partitions"],
                                            zero3.group_shapes(self.optimizer))
        cut = zero3_partition_for(per_parameter, zero3.sub_group_shapes(self.optimizer),
                                  dist.get_rank(), dist.get_world_size())
        groups = [{**{k: v for k, v in saved.items() if k != "params"},
                   "params": own["params"]}
                  for saved, own in zip(per_parameter["param_groups"],
                                        live[ZERO3_STATE]["param_groups"], strict=True)]
        return {**live, ZERO3_STATE: {"state": cut, "param_groups": groups}}


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


ENGINES: dict[str, EngineSpec] = {
    "ddp": EngineSpec(lambda i: DDPEngine(i.model, i.optimizer, i.cfg, i.device)),
    "deepspeed": EngineSpec(
        lambda i: DeepSpeedEngine(i.model, i.optimizer, i.cfg, i.micro_batch),
        process_group=True, flat_partitions=True, check=deepspeed_check,
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
