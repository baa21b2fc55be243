"""Sharded checkpoints (``checkpoint.format=sharded``): the model and optimiser state written
by every rank with PyTorch's distributed checkpoint (DCP, ``torch.distributed.checkpoint``)
into ``step_N/state/``: under FSDP2 each rank writes its own shards and no rank gathers the
whole model; under DDP the replicated tensors are written once (DCP deduplicates them).

With ``checkpoint.async_save`` DCP copies the state to CPU memory and writes it from a
background thread over a gloo group of its own (the training's collectives keep theirs), so
training goes on during the write; the checkpointer completes the checkpoint later.

Loading reads into the layout the resuming run has, whatever wrote it: FSDP2 or DDP, any
number of ranks (DCP cuts each rank's shards out of the saved ones). :func:`model_state`
reads the model's tensors whole in one process, for the registry and evaluation.
"""

from __future__ import annotations

import pickle
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
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


class AsyncWriter:
    """``checkpoint.async_save``: each call copies the state to CPU memory (a snapshot: the
    next optimiser step cannot change what is written) and returns while a background
    thread writes it. Its collectives run over a gloo group made for it (every rank makes
    it in the same order, on the first save), so they never interleave with the
    training's."""

    def __init__(self) -> None:
        self.group: dist.ProcessGroup | None = None

    def __call__(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 directory: Path) -> Future:
        if dist.is_initialized() and self.group is None:
            self.group = dist.new_group(backend="gloo")
        return dcp.async_save(state_dicts(model, optimizer), checkpoint_id=str(directory),
                              process_group=self.group, no_dist=not dist.is_initialized())


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
    reader = CheckedReader(str(directory))
    metadata = reader.read_metadata()
    whole = {key: torch.empty(entry.size, dtype=entry.properties.dtype)
             for key, entry in metadata.state_dict_metadata.items()
             if key.startswith(prefix) and isinstance(entry, TensorStorageMetadata)}
    dcp.load(whole, storage_reader=reader, no_dist=True)
    return {key[len(prefix):]: value for key, value in whole.items()}


class MetadataUnpickler(pickle.Unpickler):
    """DCP's ``.metadata`` is a pickle: only its own record classes, paths, sizes and
    dtypes are rebuilt; any other global (a callable that would run) is refused."""

    ALLOWED = {("pathlib", "PosixPath"), ("torch", "Size"),
               ("torch.serialization", "_get_layout"),
               ("torch.distributed.checkpoint.filesystem", "_StorageInfo")}

    def find_class(self, module: str, name: str) -> Any:
        value = getattr(torch, name, None) if module == "torch" else None
        record = module == "torch.distributed.checkpoint.metadata" and \
            name.lstrip("_")[:1].isupper()  # its record classes and enums
        if (module, name) in self.ALLOWED or record or \
                isinstance(value, torch.dtype | torch.layout | torch.memory_format):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"checkpoint metadata names {module}.{name}, which a "
                                     "DCP checkpoint does not hold: refused")


class CheckedReader(FileSystemReader):
    """DCP's file reader whose metadata goes through :class:`MetadataUnpickler` (a
    checkpoint handed to evaluation may come from anywhere)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        with open(Path(self.path) / ".metadata", "rb") as file:
            metadata = MetadataUnpickler(file).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(f"{self.path}/.metadata: not DCP metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
