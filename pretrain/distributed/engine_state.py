"""The engine's part of a checkpoint (``pretrain/run/checkpoint.py`` holds the rest): the
model and optimiser state written into ``shared.pt`` and the ranks' files, or written by
every rank with DCP, and read back into the engine of this run."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from pretrain.distributed.engine_base import Engine
from pretrain.run.checkpoint import CheckpointConfig
from pretrain.run.reshard import per_parameter_state
from pretrain.run.sharded import FORMAT as SHARDED_FORMAT
from pretrain.run.sharded import STATE_DIR as SHARDED_STATE_DIR


def add_engine_state(engine: Engine, cfg: CheckpointConfig, replicated: dict[str, Any],
                     per_rank: dict[str, Any]) -> Callable[[Path], Future | None] | None:
    """The model and optimiser state into ``replicated`` (written once, by rank 0) and
    ``per_rank`` (this rank's optimiser partition under ZeRO); with
    ``checkpoint.format=sharded``, the function every rank calls to write its shards."""
    if cfg.format == "sharded":
        replicated["state"] = SHARDED_FORMAT
        return engine.save_sharded_async if cfg.async_save else engine.save_sharded
    state = engine.state_dict()
    replicated["model"] = state["model"]
    (per_rank if engine.optimizer_sharded else replicated)["optimizer"] = state["optimizer"]
    return None


def load_engine_state(engine: Engine, replicated: dict[str, Any], per_rank: dict[str, Any],
                      path: Path) -> None:
    """The model and optimiser state of checkpoint ``path``: sharded (DCP, read by every
    rank), or in ``shared.pt`` and, for ZeRO, the ranks' partitions (cut for this rank's,
    or joined per parameter for a run that keeps a torch optimiser)."""
    if replicated.get("state") == SHARDED_FORMAT:
        engine.load_sharded(path / SHARDED_STATE_DIR)
        return
    state = {"model": replicated["model"]}
    if "optimizer_partitions" in per_rank and not engine.optimizer_sharded:
        shapes = [[p.shape for p in group["params"]]  # ZeRO's -> this run's torch one
                  for group in engine.optimizer.param_groups]
        state["optimizer"] = per_parameter_state(per_rank["optimizer_partitions"], shapes)
    elif "optimizer_partitions" in per_rank:  # ZeRO partitions of another number of ranks
        state["optimizer_partitions"] = per_rank["optimizer_partitions"]
    else:
        state["optimizer"] = (per_rank if engine.optimizer_sharded
                              else replicated)["optimizer"]
    engine.load_state_dict(state)
