"""Memory-mapped arrays read and written without their pages staying resident: the same
values, and the mapping's resident pages (``/proc/self/smaps``) bounded by the budget."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from data_pipeline.graph.pages import PagedRows, drop_pages

MIB = 2**20


def mapped_resident_bytes(path: Path) -> int:
    """The resident bytes of this process's mappings of ``path``."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and len(fields) >= 5:  # a mapping's first line
            inside = fields[-1] == str(path)
        elif inside and fields[0] == "Rss:":
            total += int(fields[1]) * 1024
    return total


@pytest.fixture
def stored(tmp_path) -> tuple[Path, np.ndarray]:
    rows = np.random.default_rng(0).normal(size=(16 * MIB // 256, 128)).astype(np.float16)
    np.save(tmp_path / "rows.npy", rows)
    return tmp_path / "rows.npy", rows


def test_paged_rows_read_what_the_array_holds(stored):
    path, rows = stored
    paged = PagedRows(np.load(path, mmap_mode="r"), budget=MIB)
    index = np.random.default_rng(1).permutation(len(rows))[:5000]
    assert paged.shape == rows.shape and paged.dtype == rows.dtype and len(paged) == len(rows)
    np.testing.assert_array_equal(paged[100:4000], rows[100:4000])
    np.testing.assert_array_equal(paged[index], rows[index])
    np.testing.assert_array_equal(paged[7], rows[7])


def test_a_pass_through_paged_rows_keeps_about_a_budget_of_pages(stored):
    """A plain memory map keeps every page a pass touched (16 MiB here); read through
    :class:`PagedRows` with a 1 MiB budget, at most the budget and a chunk stay."""
    path, rows = stored
    plain = np.load(path, mmap_mode="r")
    for start in range(0, len(plain), 4096):
        np.array(plain[start:start + 4096])
    assert mapped_resident_bytes(path) > 15 * MIB
    del plain
    paged = PagedRows(np.load(path, mmap_mode="r"), budget=MIB)
    for start in range(0, len(paged), 4096):  # chunks of 1 MiB
        paged[start:start + 4096]
    scattered = np.random.default_rng(2).permutation(len(paged))
    for start in range(0, len(scattered), 256):
        paged[scattered[start:start + 256]]
    assert mapped_resident_bytes(path) <= 3 * MIB
    np.testing.assert_array_equal(paged[:], rows)  # reads larger than the budget: in pieces
    assert mapped_resident_bytes(path) <= 3 * MIB
    np.testing.assert_array_equal(paged[scattered], rows[scattered])
    assert mapped_resident_bytes(path) <= 3 * MIB


def test_dropped_pages_of_a_written_map_keep_what_was_written(tmp_path):
    path = tmp_path / "out.npy"
    out = np.lib.format.open_memmap(path, mode="w+", dtype=np.int64, shape=(MIB // 8 * 4,))
    for start in range(0, len(out), MIB // 8):
        out[start:start + MIB // 8] = np.arange(start, start + MIB // 8)
        drop_pages(out)
    assert mapped_resident_bytes(path) < MIB
    np.testing.assert_array_equal(out, np.arange(len(out)))
    del out
    np.testing.assert_array_equal(np.load(path), np.arange(MIB // 8 * 4))


def test_drop_pages_leaves_arrays_in_memory_alone():
    values = np.arange(10)
    drop_pages(values, values[2:5])
    np.testing.assert_array_equal(values, np.arange(10))
