"""Sharded checkpoints (``checkpoint.format=sharded``): the model and optimiser state written
by every rank with PyTorch's distributed checkpoint (DCP, ``torch.distributed.checkpoint``)
into ``step_N/state/``: under FSDP2 each rank writes its own shards and no rank gathers the
whole model; under DDP the replicated tensors are written once (DCP deduplicates them).

Loading reads into the layout the resuming run has, whatever wrote it: FSDP2 or DDP, any
number of ranks (DCP cuts each rank's shards out of the saved ones). :func:`model_state`
reads the model's tensors whole in one process, for the registry and evaluation.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

STATE_DIR = "state"  # under a checkpoint directory: the DCP files
FORMAT = "dcp"  # shared.pt's "state" entry in a sharded checkpoint


def state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The model's and the optimiser's state in this rank's layout (FSDP2: its DTensor
    shards), keyed by parameter name (wrappers' prefixes removed)."""
    return {"model": get_model_state_dict(model),
            "optimizer": get_optimizer_state_dict(model, optimizer)}


def save_sharded(model: nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> None:
    """Write the state into ``directory`` (a collective: every rank calls it)."""
    dcp.save(state_dicts(model, optimizer), checkpoint_id=str(directory),
             no_dist=not dist.is_initialized())


def load_sharded(model: nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> None:
    """Read the state of ``directory`` into this rank's model and optimiser (a collective)."""
    state = state_dicts(model, optimizer)
    dcp.load(state, checkpoint_id=str(directory), no_dist=not dist.is_initialized())
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optimizer"])


def model_state(directory: Path) -> dict[str, Tensor]:
    """The model's tensors of a sharded checkpoint state, whole, read by this process
    alone."""
    return read_whole(directory, "model.")


def read_whole(directory: Path, prefix: str) -> dict[str, Tensor]:
    """The tensors of a sharded checkpoint state whose names start with ``prefix``
    (``model.``; ``optimizer.state.``), whole, keyed by the rest of their names, read by
    this process alone (their sizes and dtypes from the checkpoint's metadata)."""
    metadata = FileSystemReader(str(directory)).read_metadata()
    whole = {key: torch.empty(entry.size, dtype=entry.properties.dtype)
             for key, entry in metadata.state_dict_metadata.items()
             if key.startswith(prefix) and isinstance(entry, TensorStorageMetadata)}
    dcp.load(whole, checkpoint_id=str(directory), no_dist=True)
    return {key[len(prefix):]: value for key, value in whole.items()}
