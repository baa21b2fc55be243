"""The caption job's on-disk pieces and the streamed merges over them (docs/graph.md).

A collect part p is three files (the merge adds a fourth), each sorted so that every later
phase reads all parts as a k-way merge of sorted streams (``heapq.merge``) and holds a
block of values over all parts together (:func:`part_block`), never a data set:

- ``captions-p.jsonl``: the part's captions, one JSON string a line, sorted (duplicates kept);
- ``keys-p.npy`` [n] fixed-width bytes: the part's keys, sorted;
- ``lines-p.npy`` [n] int64: for each sorted key, its caption's line in ``captions-p.jsonl``;
- ``rows-p.npy`` [n] int32: the merge's embedding row of each line of ``captions-p.jsonl``.

A sidecar ``captions-p.json`` (written last, atomically) holds the counts and the checksum of
all three. Chunks of embeddings (``chunks/chunk-c.npy``) have their own sidecars.
"""

from __future__ import annotations

import heapq
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO, NamedTuple

import numpy as np

from data_pipeline.manifest import file_sha256

BLOCK = 65_536  # values buffered per output file, and over all parts' files together
MIN_PART_BLOCK = 256  # values buffered per part's file at the least


def part_block(num_parts: int) -> int:
    """Values to buffer per part's file when all ``num_parts`` are open at once: BLOCK
    over all of them (a merge of many small parts would otherwise hold every part whole)."""
    return max(MIN_PART_BLOCK, BLOCK // max(num_parts, 1))


def write_atomic(path: Path, write: Callable[[BinaryIO], object]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as handle:
        write(handle)
    os.replace(tmp, path)


def finish(files: list[Path], info: dict) -> dict:
    """Write the sidecar of ``files[0]`` with ``info`` and the checksum of every file."""
    info = info | {"sha256": {f.name: file_sha256(f) for f in files}}
    write_atomic(files[0].with_suffix(".json"), lambda h: h.write(json.dumps(info).encode()))
    return info


def valid(data: Path) -> dict | None:
    """The sidecar of a finished file (and its companions) whose checksums still match."""
    try:
        info = json.loads(data.with_suffix(".json").read_text())
        ok = all(file_sha256(data.with_name(n)) == s for n, s in info["sha256"].items())
        return info if ok and data.name in info["sha256"] else None
    except (OSError, ValueError, KeyError, AttributeError):
        return None


class PartFiles(NamedTuple):
    captions: Path
    keys: Path
    lines: Path
    rows: Path  # written by the merge: [n] int32 embedding row of each caption line

    @classmethod
    def of(cls, directory: Path, part: int) -> PartFiles:
        name = f"{part:05d}"
        return cls(directory / f"captions-{name}.jsonl", directory / f"keys-{name}.npy",
                   directory / f"lines-{name}.npy", directory / f"rows-{name}.npy")


def write_part(files: PartFiles, pairs: list[tuple[str, str]], info: dict) -> dict:
    """Write one part's (key, caption) ``pairs`` sorted as the module docstring says."""
    by_caption = sorted(range(len(pairs)), key=lambda i: (pairs[i][1], pairs[i][0]))
    text = "".join(json.dumps(pairs[i][1], ensure_ascii=False) + "\n" for i in by_caption)
    line_of = np.empty(len(pairs), np.int64)
    line_of[by_caption] = np.arange(len(pairs))
    keys = np.array([k.encode() for k, _ in pairs], dtype=f"S{max_width(pairs)}")
    order = np.argsort(keys, kind="stable")
    write_atomic(files.keys, lambda h: np.save(h, keys[order]))
    write_atomic(files.lines, lambda h: np.save(h, line_of[order]))
    write_atomic(files.captions, lambda h: h.write(text.encode("utf-8")))
    return finish(list(files[:3]), info | {"samples": len(pairs), "key_width": keys.dtype.itemsize})


def max_width(pairs: list[tuple[str, str]]) -> int:
    return max((len(k.encode()) for k, _ in pairs), default=1) or 1


def _captions(path: Path, part: int) -> Iterator[tuple[str, int]]:
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            yield json.loads(line), part


def merged_captions(parts: list[PartFiles]) -> Iterator[tuple[str, int]]:
    """(caption, part) of every sample of all parts, in caption order."""
    return heapq.merge(*(_captions(p.captions, i) for i, p in enumerate(parts)))


def distinct_captions(parts: list[PartFiles]) -> Iterator[str]:
    """The distinct captions of all parts, sorted (what ``sorted(set(...))`` gives)."""
    previous = None
    for caption, _ in merged_captions(parts):
        if caption != previous:
            previous = caption
            yield caption


def _keyed_rows(files: PartFiles, size: int) -> Iterator[tuple[bytes, int]]:
    keys, lines = (np.load(p, mmap_mode="r") for p in (files.keys, files.lines))
    rows = np.load(files.rows, mmap_mode="r")
    for start in range(0, len(keys), size):
        block = slice(start, start + size)
        yield from zip(keys[block].tolist(), rows[lines[block]].tolist(), strict=True)


def merged_keys(parts: list[PartFiles]) -> Iterator[tuple[bytes, int]]:
    """(key, embedding row) of every sample of all parts, in key byte order (after the
    merge has written each part's ``rows``)."""
    size = part_block(len(parts))
    return heapq.merge(*(_keyed_rows(p, size) for p in parts))


class NpyWriter:
    """Writes an ``.npy`` file of known shape front to back through a plain file (the
    bytes ``np.save`` would write), so that what is written leaves memory as it goes (a
    memory map would keep the dirty pages resident); ``block`` values at a time."""

    def __init__(self, path: Path, shape: tuple[int, ...], dtype: np.dtype | str,
                 block: int = BLOCK) -> None:
        self.path, self.tmp, self.block = path, path.with_name(path.name + ".tmp"), block
        self.shape, self.dtype = shape, np.dtype(dtype)
        self.handle = open(self.tmp, "wb")
        np.lib.format.write_array_header_1_0(self.handle, {
            "descr": np.lib.format.dtype_to_descr(self.dtype), "fortran_order": False,
            "shape": shape})
        self.buffer: list = []
        self.rows = 0

    def add(self, value) -> None:
        self.buffer.append(value)
        if len(self.buffer) == self.block:
            self.flush()

    def write(self, rows: np.ndarray) -> None:
        """Append whole rows (after the values ``add`` buffered)."""
        self.flush()
        self.handle.write(np.ascontiguousarray(rows, self.dtype).tobytes())
        self.rows += len(rows)

    def flush(self) -> None:
        if self.buffer:
            self.handle.write(np.array(self.buffer, self.dtype).tobytes())
            self.rows += len(self.buffer)
            self.buffer = []

    def close(self) -> None:
        self.flush()
        self.handle.close()
        if self.rows != self.shape[0]:
            raise RuntimeError(f"{self.path}: wrote {self.rows} of {self.shape[0]} rows")
        os.replace(self.tmp, self.path)
