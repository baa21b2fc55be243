"""A CC3M/CC12M-style caption table (CSV or TSV of caption and local image path) as a
make-shards source that no process holds whole.

The constructor makes one streaming pass over the table and writes the byte offset of
every record to a temporary file of int64 (8 bytes a row: 96 MB for CC12M's 12M rows, where
the rows themselves would be ~3.5 GB of Python strings in every worker). Workers map that
file (the pages they touch are shared through the page cache) and ``load(i)`` seeks
straight to row ``i``: make-shards asks for rows in a seeded random order, and each row is
read once, by the worker writing its shard. What travels to a worker is the file's name.
"""

from __future__ import annotations

import csv
import os
import tempfile
import weakref
from array import array
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import numpy as np

from core.errors import RunError
from data_pipeline.config import ShardsConfig
from data_pipeline.formats import IMAGE_SUFFIXES, Sample, SkipSample
from data_pipeline.image_tree import read_class_names
from data_pipeline.images import check_image

URL_PREFIXES = ("http://", "https://")
URL_PROBE_ROWS = 100  # rows looked at for image URLs before any work starts


class ImageURLs(RunError):
    """A caption table that lists image URLs instead of local files."""


def records(handle: BinaryIO) -> Iterator[tuple[int, bytes]]:
    """(byte offset, line) of each line of ``handle`` from its current position."""
    offset = handle.tell()
    for line in iter(handle.readline, b""):
        yield offset, line
        offset += len(line)


def rows(handle: BinaryIO, delimiter: str) -> Iterator[tuple[int, list[str]]]:
    """(byte offset, fields) of each CSV record of ``handle`` from its current position.
    csv's reader takes one line at a time and returns a record as soon as its quotes
    close, so a record's offset is that of the first line it took, also when a quoted
    field spans lines. Lines are decoded as UTF-8 with undecodable bytes replaced (a
    newline byte never sits inside a UTF-8 sequence)."""
    starts: list[int] = []  # offsets of the lines the reader took for this record

    def lines() -> Iterator[str]:
        for offset, line in records(handle):
            starts.append(offset)
            yield line.decode("utf-8", errors="replace")

    for fields in csv.reader(lines(), delimiter=delimiter):
        yield starts[0], fields
        starts.clear()


def _column(spec: str, header: list[str], table: Path) -> int:
    if spec.isdigit():
        return int(spec)
    if spec not in header:
        raise ValueError(f"caption table {table}: no column {spec!r} in header {header}")
    return header.index(spec)


class CaptionTableSource:
    """Rows of a caption table as samples keyed ``row_<index>`` (index 0 = the first row
    after the header); bad rows raise :class:`SkipSample`."""

    def __init__(self, cfg: ShardsConfig) -> None:
        table = Path(cfg.input)
        if not table.is_file():
            raise FileNotFoundError(f"caption table {table}: not found")
        if cfg.label_column and not cfg.class_names:
            raise ValueError(f"caption table {table}: shards.label_column needs "
                             "shards.class_names (a file of one name per line, or imagenet1k)")
        self.table = table
        self.class_names = read_class_names(cfg.class_names) if cfg.label_column else []
        self.delimiter = cfg.delimiter or ("\t" if table.suffix.lower() == ".tsv" else ",")
        self.root = Path(cfg.image_root) if cfg.image_root else table.parent
        self.max_pixels = cfg.max_image_pixels
        self.count = 0
        handle_fd, self.offsets_path = tempfile.mkstemp(prefix="caption-rows-", suffix=".i64")
        weakref.finalize(self, _remove, self.offsets_path)  # in this process only
        chunk = array("q")
        with open(table, "rb") as handle, os.fdopen(handle_fd, "wb") as offsets:
            stream = rows(handle, self.delimiter)
            header = next(stream, (0, []))[1] if cfg.has_header else []
            self.caption_col = _column(cfg.caption_column, header, table)
            self.image_col = _column(cfg.image_column, header, table)
            self.label_col = (_column(cfg.label_column, header, table) if cfg.label_column
                              else None)
            for offset, fields in stream:
                if self.count < URL_PROBE_ROWS:
                    self._refuse_urls(fields, cfg.image_column)
                chunk.append(offset)
                if len(chunk) == 1 << 16:
                    chunk.tofile(offsets)
                    chunk = array("q")
                self.count += 1
            chunk.tofile(offsets)
        self._offsets: np.ndarray | None = None

    def _refuse_urls(self, fields: list[str], column: str) -> None:
        if len(fields) > self.image_col and fields[self.image_col].startswith(URL_PREFIXES):
            raise ImageURLs(f"caption table {self.table}: column {column!r} holds URLs "
                            f"({fields[self.image_col][:60]}); make-shards reads local images: "
                            "download them with img2dataset and index its output "
                            "(shards.source=img2dataset)")

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_offsets": None}  # workers map the file themselves

    def __len__(self) -> int:
        return self.count

    def _row(self, i: int) -> list[str]:
        """Row ``i``, read from its recorded offset."""
        if self._offsets is None:
            self._offsets = (np.memmap(self.offsets_path, np.int64, "r") if self.count
                             else np.zeros(0, np.int64))
        with open(self.table, "rb") as handle:
            handle.seek(int(self._offsets[i]))
            return next(rows(handle, self.delimiter))[1]

    def load(self, i: int) -> Sample:
        row = self._row(i)
        where = f"row {i + 1}"
        if len(row) <= max(self.caption_col, self.image_col, self.label_col or 0):
            raise SkipSample("bad_row", f"{where}: {len(row)} columns")
        label = (None if self.label_col is None
                 else _label(row[self.label_col], len(self.class_names), where))
        caption = row[self.caption_col].strip()
        if not caption:
            raise SkipSample("bad_caption", f"{where}: empty caption")
        if "\ufffd" in caption:
            raise SkipSample("bad_caption", f"{where}: not valid UTF-8")
        path = Path(row[self.image_col])
        path = path if path.is_absolute() else self.root / path
        if path.suffix.lower() not in IMAGE_SUFFIXES or not path.is_file():
            raise SkipSample("missing_image", f"{where}: {path}")
        data = path.read_bytes()
        check_image(data, str(path), self.max_pixels)
        return Sample(key=f"row_{i:09d}", image=data, ext=IMAGE_SUFFIXES[path.suffix.lower()],
                      label=label, caption=caption)


def _label(field: str, classes: int, where: str) -> int:
    text = field.strip()
    if not text.isdigit() or int(text) >= classes:  # a class index: 0 .. classes - 1
        raise SkipSample("bad_label", f"{where}: label {text[:20]!r} of {classes} classes")
    return int(text)


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass
