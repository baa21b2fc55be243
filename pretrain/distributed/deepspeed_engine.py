"""The DeepSpeed entry of the engine table (``engine.py``): ZeRO stage 1, 2 or 3 around our
optimiser, with checkpoints every engine can read (stage 3's model gathered: ``zero3.py``;
optimiser partitions cut anew for another number of ranks: ``pretrain/run/reshard.py``)."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from core.config import InvalidValue
from pretrain.distributed import zero3
from pretrain.distributed.engine_base import Engine
from pretrain.run.checkpoint import Unresumable
from pretrain.run.reshard import (
    SUB_GROUPS,
    ZERO3_STATE,
    per_parameter_state,
    zero3_partition_for,
    zero_partition_for,
    zero_stage_of,
)


def own_extension_cache() -> Path | None:
    """The folder DeepSpeed builds its CPU communication op in (``TORCH_EXTENSIONS_DIR``),
    set to one inside this virtual environment unless the user named one; None (torch's
    default) outside a virtual environment, whose prefix may not be writable.

    torch's default, ``~/.cache/torch_extensions``, is shared by every checkout of a user,
    and the op's build file holds the absolute paths of the environment that built it: a
    second environment rebuilds it (about 30 s of compiling on 2 cores, while every rank of
    the run waits on the build's file lock), and the first rebuilds it again the next time
    it runs."""
    if sys.prefix != sys.base_prefix:
        os.environ.setdefault("TORCH_EXTENSIONS_DIR",
                              str(Path(sys.prefix) / "torch_extensions"))
    named = os.environ.get("TORCH_EXTENSIONS_DIR")
    return Path(named) if named else None


def read_deepspeed_config(path: str) -> dict[str, Any]:
    """The DeepSpeed JSON at ``path``; it must set gradient_clipping (DeepSpeed would
    otherwise clip silently at 1.0) and a ZeRO stage of 1, 2 or 3, and leave DeepSpeed's
    own fp16/bf16 off (precision is ``train.precision``)."""
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
    for key in ("fp16", "bf16"):
        if config.get(key, {}).get("enabled", False):
            raise InvalidValue("deepspeed_config", f"{path}: \"{key}\" is enabled; precision is "
                                                   "train.precision (our autocast, parameters in "
                                                   "fp32), so leave it out of the DeepSpeed JSON")
    stage = config.get("zero_optimization", {}).get("stage", 0)
    if stage not in (1, 2, 3):
        raise InvalidValue("deepspeed_config", f"{path}: zero_optimization.stage must be 1, 2 or "
                                               f"3, got {stage}")
    return config


class DeepSpeedEngine(Engine):
    """DeepSpeed ZeRO stage 1, 2 or 3 around our optimiser (LARS included). Under stage 3
    every rank holds 1/N of each parameter (``zero3.py``): every forward gathers
    parameters, a collective, as under FSDP2."""

    optimizer_sharded = True
    _UNSAFE_KEYS = ("loss_scaler", "param_slice_mappings", "zero_stage")  # live objects

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 config_path: str, micro_batch: int) -> None:
        own_extension_cache()
        import deepspeed

        config = read_deepspeed_config(config_path)
        config.update(train_micro_batch_size_per_gpu=micro_batch, gradient_accumulation_steps=1)
        self.stage = "3" if config["zero_optimization"]["stage"] == 3 else "1/2"  # layouts
        self.shards_parameters = self.stage == "3"
        self.round_robin = config["zero_optimization"].get("round_robin_gradients", False)
        if self.shards_parameters and zero3.refused_dtype(model):
            zero3.partition(model, config)
        self.ds, zero_optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, config=config, dist_init_required=False)
        if self.shards_parameters:
            zero3.zero_padding(zero_optimizer)
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
        """ZeRO-3: the model loaded module by module, the partitions' padding zeroed and the
        fp32 partitions refreshed from them; this rank's optimizer state, its own, or cut
        from the partitions of another number of ranks joined per parameter."""
        zero3.load_model_state(self.module, state["model"])
        zero3.zero_padding(self.optimizer)  # and the fp32 partitions refreshed
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
