"""The kNN bank on disk, so that no process holds it: each rank appends the features of its
share of the bank to files of its own as it embeds them; rank 0 then orders every rank's
keys (the bank's order is key order, whatever the number of ranks) and reads rows through
that order, a block at a time. What rank 0 keeps is 8 bytes a sample for the order and 8
for the labels; the features stay in the files (4 bytes a value) until the evaluation
ends. The files are read through short-lived memory maps (a read copies its rows out and
unmaps), so the process's resident memory holds a block, not the pages of the files.

The directory must be one every rank writes and rank 0 reads, as the run directory is for
checkpoints.
"""

from __future__ import annotations

import mmap
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

SPACES = ("backbone", "projector")


def read_rows(path: Path, shape: tuple[int, int], rows: np.ndarray) -> np.ndarray:
    """Rows ``rows`` of the float32 [n, d] file ``path``, copied out of a map of it that is
    closed before returning."""
    if len(rows) == 0:
        return np.empty((0, shape[1]), np.float32)
    with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0,
                                               access=mmap.ACCESS_READ) as mapped:
        view = np.frombuffer(mapped, np.float32, shape[0] * shape[1]).reshape(shape)
        out = view[rows]  # an index array: a copy
        del view  # the map closes only when nothing views it
    return out


@dataclass
class RowFiles:
    """[n, d] float32 rows kept in one file per rank, read in key order: row i is row
    ``position[i]`` of the ranks' files joined in rank order. A slice or an index tensor
    reads rows as it would from a [n, d] tensor, on the CPU."""

    paths: list[Path]
    counts: list[int]  # rows of each rank's file
    dim: int
    position: np.ndarray  # [n] int64
    starts: np.ndarray = field(init=False)  # [world] first joined row of each rank

    def __post_init__(self) -> None:
        self.starts = np.concatenate([[0], np.cumsum(self.counts)[:-1]]).astype(np.int64)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((len(self.position), self.dim))

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    def __len__(self) -> int:
        return len(self.position)

    def __getitem__(self, rows: slice | Tensor | np.ndarray) -> Tensor:
        if isinstance(rows, Tensor):
            rows = rows.cpu().numpy()
        joined = self.position[rows]
        owner = np.searchsorted(self.starts, joined, side="right") - 1
        out = np.empty((len(joined), self.dim), np.float32)
        for rank, path in enumerate(self.paths):
            mine = owner == rank
            if mine.any():
                out[mine] = read_rows(path, (self.counts[rank], self.dim),
                                      joined[mine] - self.starts[rank])
        return torch.from_numpy(out)


@dataclass
class Bank:
    """The bank's labels (in memory) and features (:class:`RowFiles`), in key order."""

    labels: Tensor  # [n] int64 (-1: unlabelled)
    backbone: RowFiles  # [n, F]
    projector: RowFiles  # [n, P]
    class_names: list[str]
    directory: Path

    def __len__(self) -> int:
        return len(self.labels)

    def remove(self) -> None:
        """Deletes the files (rank 0, when the evaluation no longer reads them)."""
        shutil.rmtree(self.directory, ignore_errors=True)


def rank_file(directory: Path, rank: int, what: str) -> Path:
    suffix = {"keys": "npy", "labels": "npy"}.get(what, "f32")
    return directory / f"rank{rank}.{what}.{suffix}"


class BankWriter:
    """One rank's share of the bank, appended batch by batch in the order it is read (keys
    and labels kept, as fixed-width bytes and int64, until :meth:`close`)."""

    def __init__(self, directory: Path, rank: int) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.directory, self.rank = directory, rank
        self.files = {space: open(rank_file(directory, rank, space), "wb") for space in SPACES}
        self.keys: list[np.ndarray] = []
        self.labels: list[np.ndarray] = []

    def add(self, keys: Sequence[str], labels: Tensor, spaces: dict[str, Tensor]) -> None:
        self.keys.append(np.array([key.encode() for key in keys], dtype=bytes))
        self.labels.append(labels.cpu().numpy().astype(np.int64))
        for space, rows in spaces.items():
            self.files[space].write(rows.float().cpu().contiguous().numpy().tobytes())

    def close(self) -> None:
        for handle in self.files.values():
            handle.close()
        keys = np.concatenate(self.keys) if self.keys else np.array([], dtype="S1")
        labels = np.concatenate(self.labels) if self.labels else np.array([], np.int64)
        np.save(rank_file(self.directory, self.rank, "keys"), keys)
        np.save(rank_file(self.directory, self.rank, "labels"), labels)


def open_bank(directory: Path, world: int, widths: dict[str, int],
              class_names: list[str]) -> Bank:
    """The bank every rank wrote to ``directory``, in key order (on rank 0, once all have
    closed their writers)."""
    keys = [np.load(rank_file(directory, rank, "keys")) for rank in range(world)]
    counts = [len(k) for k in keys]
    position = np.argsort(np.concatenate(keys), kind="stable")
    del keys
    labels = np.concatenate([np.load(rank_file(directory, rank, "labels"))
                             for rank in range(world)])[position]
    spaces = {space: RowFiles([rank_file(directory, rank, space) for rank in range(world)],
                              counts, widths[space], position) for space in SPACES}
    return Bank(torch.from_numpy(labels), spaces["backbone"], spaces["projector"],
                class_names, directory)
