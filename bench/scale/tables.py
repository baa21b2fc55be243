"""The caption tables, img2dataset tars and remote shard lists the scale benchmark
(``python -m bench.scale``) measures its ingestion parts on: ``captions``, ``index`` and
``counts``."""

from __future__ import annotations

import csv
import io
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from bench.common import peak_rss_bytes
from bench.processes import run_command
from bench.scale.ingest import make_shards_measured

CC12M_ROWS, CC12M_SHARDS = 12_000_000, 1_200
SHARD = 10_000
IMAGES = 256  # distinct image files the table's rows point at


def tiny_jpegs(folder: Path, classes: int = 0) -> list[str]:
    """``IMAGES`` 16 px JPEGs of random pixels; with ``classes``, tinted by class i % classes."""
    folder.mkdir(parents=True, exist_ok=True)
    gen = np.random.default_rng(0)
    names = []
    for i in range(IMAGES):
        path = folder / f"{i:04d}.jpg"
        if not path.is_file():
            pixels = (gen.integers(0, 256, (16, 16, 3), dtype=np.uint8) if not classes else
                      gen.integers(0, 40, (16, 16, 3), dtype=np.uint8) + 25 * (i % classes))
            Image.fromarray(pixels.astype(np.uint8)).save(path, quality=90)
        names.append(f"images/{path.name}")
    return names


def caption_table(root: Path, rows: int) -> Path:
    """A CC3M-style TSV (caption, image path) of ``rows`` rows: captions of about CC12M's
    length (~100 characters), images from a pool of tiny JPEGs."""
    table = root / f"captions-{rows}.tsv"
    if table.is_file():
        return table
    images = tiny_jpegs(root / "images")
    gen = np.random.default_rng(rows)
    words = ["a", "photo", "of", "the", "dog", "cat", "on", "red", "blue", "street", "with",
             "in", "person", "holding", "sunset", "over", "beach", "and", "two", "old"]
    with open(table, "w", newline="") as handle:
        writer = csv.writer(handle, delimiter="\t")
        for i in range(rows):
            caption = " ".join(words[j] for j in gen.integers(0, len(words), 18))
            writer.writerow([f"{caption} {i}", images[i % IMAGES]])
    return table


def run_captions(rows: int, workdir: Path) -> dict[str, Any]:
    """make-shards of a table of ``rows`` rows."""
    table = caption_table(workdir, rows)
    result = make_shards_measured([
        "shards.source=captions", f"shards.input={table}", "shards.caption_column=0",
        "shards.image_column=1", "shards.has_header=false"], workdir / f"shards-{rows}", rows)
    return {"rows": rows, **result, "rows_per_s": rows / result["seconds"],
            "table_mib": table.stat().st_size / 2**20}


def run_whole_table(rows: int, workdir: Path) -> dict[str, Any]:
    """Child process: the table read whole into Python rows (the earlier source's way)."""
    table = caption_table(workdir, rows)
    before = peak_rss_bytes()
    with open(table, newline="", encoding="utf-8") as handle:
        loaded = list(csv.reader(handle, delimiter="\t"))
    return {"rows": len(loaded), "whole_table_rss_mib": (peak_rss_bytes() - before) / 2**20}


def img2dataset_tars(folder: Path, tars: int, per_tar: int) -> None:
    from webdataset import TarWriter

    folder.mkdir(parents=True, exist_ok=True)
    payload = io.BytesIO()
    Image.new("RGB", (16, 16), (120, 30, 200)).save(payload, format="JPEG")
    for t in range(tars):
        path = folder / f"{t:05d}.tar"
        if path.is_file():
            continue
        with TarWriter(str(path)) as writer:
            for i in range(per_tar):
                writer.write({"__key__": f"{t:05d}{i:05d}", "jpg": payload.getvalue(),
                              "txt": f"caption {i}", "json": {"key": i}})


def run_index(tars: int, workers: int, workdir: Path) -> dict[str, Any]:
    folder = workdir / f"img2dataset-{tars}"
    img2dataset_tars(folder, tars, SHARD)
    result = run_command("app.make_shards", ["shards.source=img2dataset", f"shards.input={folder}",
                              f"shards.output={workdir / f'index-{tars}-{workers}'}",
                              f"shards.workers={workers}"])
    assert f"{tars * SHARD} samples" in result.pop("printed")
    return {"tars": tars, "workers": workers, **result, "tars_per_s": tars / result["seconds"]}


def run_counts(shards: int, workdir: Path) -> dict[str, Any]:
    """Requests a remote list without a manifest costs, first open and later ones."""
    import os

    from data_pipeline.shards import ShardSet
    from tests.data_pipeline.remote import ShardServer

    folder = workdir / f"remote-{shards}"
    folder.mkdir(parents=True, exist_ok=True)
    for s in range(shards):
        (folder / f"{s:05d}_stats.json").write_text(json.dumps({"successes": SHARD}))
    os.environ["XDG_CACHE_HOME"] = str(workdir / f"cache-{shards}")
    server = ShardServer(folder).start()
    try:
        url = f"{server.url}/{{00000..{shards - 1:05d}}}.tar"
        asked = []
        for _ in range(3):
            before = len(server.requests())
            start = time.perf_counter()
            assert ShardSet.open(url).total == shards * SHARD
            asked.append((len(server.requests()) - before, time.perf_counter() - start))
    finally:
        server.stop()
    return {"shards": shards, "first_open_requests": asked[0][0],
            "first_open_s": asked[0][1], "later_open_requests": asked[1][0],
            "later_open_s": asked[1][1]}
