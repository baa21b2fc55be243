"""Reading and writing memory-mapped arrays without keeping their pages in the process.

A page of a memory-mapped file that a process has touched stays in its resident set until
the kernel needs the memory back, so a pass over a store of U rows leaves U rows' worth of
pages resident: the resident peak of a search grows with the store although it holds a
block at a time. :func:`drop_pages` lets them go (``MADV_DONTNEED``): the kernel keeps
them in its page cache and writes the dirty ones back to the file, so nothing is lost and
a later read is a page-cache hit. :class:`PagedRows` drops after every ``budget`` bytes of
pages it has read.
"""

from __future__ import annotations

import mmap
from typing import Any

import numpy as np

DROP_BYTES = 64 * 2**20  # pages a reader lets accumulate before dropping them
# a fault on a page of a cached file maps the cached pages around it too (Linux's
# fault_around_bytes, 64 KiB by default): what one scattered row can bring in
FAULT_AROUND_BYTES = 64 * 2**10


def mapping(array: Any) -> mmap.mmap | None:
    """The ``mmap`` under ``array`` (a memory-mapped array or a view of one), or None."""
    base = array
    while base is not None and not isinstance(base, mmap.mmap):
        base = getattr(base, "base", None)
    return base


def drop_pages(*arrays: Any) -> None:
    """Let go of every page of the memory-mapped ``arrays`` (others are left alone)."""
    for array in arrays:
        mapped = mapping(array.array if isinstance(array, PagedRows) else array)
        if mapped is not None:
            mapped.madvise(mmap.MADV_DONTNEED)


class PagedRows:
    """The rows of an [U, d] array (``rows[i]``, ``rows[a:b]``, ``rows[index_array]``,
    each a copy), whose mapped pages are dropped after every ``budget`` bytes read: a read
    counts its rows' bytes, or ``FAULT_AROUND_BYTES`` a row where the rows are scattered,
    and a read larger than the budget is made in pieces with drops between them."""

    def __init__(self, array: np.ndarray, budget: int = DROP_BYTES) -> None:
        self.array = array
        self.budget = budget
        self.pending = 0
        self.row_bytes = int(np.prod(array.shape[1:], dtype=np.int64)) * array.dtype.itemsize

    @property
    def shape(self) -> tuple[int, ...]:
        return self.array.shape

    @property
    def dtype(self) -> np.dtype:
        return self.array.dtype

    def __len__(self) -> int:
        return len(self.array)

    def __getitem__(self, rows: Any) -> np.ndarray:
        if isinstance(rows, int | np.integer):
            return self._read(rows, self.row_bytes)
        if isinstance(rows, slice):
            rows = range(*rows.indices(len(self.array)))
            cost = self.row_bytes
        else:
            rows = np.asarray(rows)
            cost = max(self.row_bytes, FAULT_AROUND_BYTES)
        piece = max(1, self.budget // cost)
        if len(rows) <= piece:
            return self._read(_as_index(rows), cost * len(rows))
        out = np.empty((len(rows), *self.array.shape[1:]), self.array.dtype)
        for start in range(0, len(rows), piece):
            part = rows[start:start + piece]
            out[start:start + len(part)] = self._read(_as_index(part), cost * len(part))
        return out

    def _read(self, rows: Any, cost: int) -> np.ndarray:
        out = np.array(self.array[rows])
        self.pending += cost
        if self.pending >= self.budget:
            drop_pages(self.array)
            self.pending = 0
        return out


def _as_index(rows: range | np.ndarray) -> slice | np.ndarray:
    """A range as the slice it is (a view, not a gather); an index array as it is."""
    return slice(rows.start, rows.stop, rows.step) if isinstance(rows, range) else rows
