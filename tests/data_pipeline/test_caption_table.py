"""The caption table is read as a stream: its rows equal csv's reading of the whole file
(quoted fields across lines, CRLF, blank lines and undecodable bytes included), rows are
reachable in any order from the recorded offsets, and what travels to each make-shards
worker does not grow with the table."""

from __future__ import annotations

import csv
import io
import pickle
import random

import pytest

from data_pipeline.caption_table import CaptionTableSource, rows
from data_pipeline.config import ShardsConfig
from data_pipeline.formats import SkipSample


def whole_table(path, delimiter=","):
    """The reference: csv over the whole file at once, as the loader once read it."""
    with open(path, newline="", encoding="utf-8", errors="replace") as handle:
        return list(csv.reader(handle, delimiter=delimiter))


def awkward_table(path, count: int) -> None:
    """A CSV whose captions hold quoted commas, quotes, newlines and bad UTF-8."""
    gen = random.Random(0)
    out = io.BytesIO()
    out.write(b"url,image,caption\r\n")
    for i in range(count):
        kind = gen.randrange(6)
        caption = {0: f"plain caption {i}".encode(),
                   1: f'"a caption, with a comma {i}"'.encode(),
                   2: f'"two\nlines {i}"'.encode(),
                   3: f'"""quoted"" and\r\nthree\nlines {i}"'.encode(),
                   4: b"bad \xff\xfe bytes " + str(i).encode(),
                   5: b""}[kind]
        out.write(b"http://x," + f"images/{i % 3}.jpg,".encode() + caption + b"\r\n")
        if kind == 5:
            out.write(b"\r\n")  # a blank line is a record of no fields
    path.write_bytes(out.getvalue())


def test_streamed_rows_and_offsets_equal_the_whole_file(tmp_path):
    table = tmp_path / "t.csv"
    awkward_table(table, 300)
    with open(table, "rb") as handle:
        streamed = list(rows(handle, ","))
    assert [fields for _, fields in streamed] == whole_table(table)
    with open(table, "rb") as handle:
        for offset, fields in random.Random(1).sample(streamed, 50):
            handle.seek(offset)
            assert next(rows(handle, ","))[1] == fields


@pytest.mark.parametrize("stride", [1, 7, 1000])
def test_rows_in_any_order_equal_rows_in_order(tmp_path, stride):
    table = tmp_path / "t.csv"
    awkward_table(table, 120)
    (tmp_path / "images").mkdir()
    source = CaptionTableSource(ShardsConfig(source="captions", input=str(table),
                                             caption_column="caption", shard_size=stride))
    reference = whole_table(table)[1:]
    assert len(source) == len(reference)
    order = list(range(len(source)))
    for indexes in (order, random.Random(2).sample(order, len(order))):
        assert [source._row(i) for i in indexes] == [reference[i] for i in indexes]


def test_what_travels_to_a_worker_does_not_grow_with_the_table(tmp_path):
    sizes = {}
    for count in (1_000, 50_000):
        table = tmp_path / f"{count}.tsv"
        table.write_text("".join(f"caption number {i} of a long table\timages/{i}.jpg\n"
                                 for i in range(count)))
        source = CaptionTableSource(ShardsConfig(
            source="captions", input=str(table), caption_column="0", image_column="1",
            has_header=False, shard_size=10_000))
        assert len(source) == count
        with pytest.raises(SkipSample, match="missing_image"):
            source.load(count - 1)  # read, then found without its image
        sizes[count] = len(pickle.dumps(source))
    # 50x the rows add 4 offsets (one per shard of 10,000), not 49,000 rows
    assert sizes[50_000] - sizes[1_000] < 100, sizes
