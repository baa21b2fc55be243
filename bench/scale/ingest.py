"""Ingestion at data-set size for ``python -m bench.scale``: ``make-shards`` of an
ImageNet-style class-sorted tree and ``graph-precompute`` of a caption set, each through
its real command in a subprocess (time and peak resident memory, ``PeakMemory``), beside
what the whole data set costs held in one process (the baseline, in a child of its own);
and the caption-neighbour graph over a synthetic store (``run_neighbours``).

Payloads are tiny: the tree's images are hard links to 256 tiny JPEGs (1.28M files cost
inodes, not 1.28M image bodies), captions are ~100 characters like CC12M's.
"""

from __future__ import annotations

import io
import os
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from bench.common import PeakAnonymous, peak_rss_bytes
from bench.processes import run_command
from data_pipeline.graph.config import GraphConfig
from data_pipeline.manifest import Manifest, ShardInfo, file_sha256

SHARD = 10_000
CLASSES = 1_000
POOL = 256  # distinct image files; each is linked ~5,000 times at 1.28M (ext4 allows 65,000)
DUPLICATES = 0.2  # share of samples whose caption another sample has too
WORDS = ["a", "photo", "of", "the", "dog", "cat", "on", "red", "blue", "street", "with",
         "in", "person", "holding", "sunset", "over", "beach", "and", "two", "old"]


def image_tree(root: Path, images: int) -> Path:
    """``images`` files over ``CLASSES`` folders, listed class by class (as ImageNet's)."""
    tree = root / f"tree-{images}"
    if (tree / "done").is_file():
        return tree
    pool = root / "pool"
    pool.mkdir(parents=True, exist_ok=True)
    gen = np.random.default_rng(0)
    for j in range(POOL):
        Image.fromarray(gen.integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(
            pool / f"{j}.JPEG", quality=90)
    for c in range(CLASSES):
        (tree / f"n{c:08d}").mkdir(parents=True, exist_ok=True)
    for i in range(images):
        link = tree / f"n{i % CLASSES:08d}" / f"n{i % CLASSES:08d}_{i:07d}.JPEG"
        if not link.exists():
            os.link(pool / f"{i % POOL}.JPEG", link)
    (tree / "done").write_text("")
    return tree


def make_shards_measured(source: list[str], out: Path, samples: int) -> dict[str, float]:
    """The real make-shards of ``source`` overrides into ``out`` (2 workers, shards of
    ``SHARD``), measured; it must write ``samples`` samples; ``out`` is removed after."""
    result = run_command("app.make_shards", [*source, f"shards.output={out}",
                                             f"shards.shard_size={SHARD}", "shards.workers=2"])
    assert f"{samples} samples" in result.pop("printed")
    shutil.rmtree(out)
    return result


def run_tree(images: int, workdir: Path) -> dict[str, Any]:
    """make-shards of a class-sorted tree of ``images`` images (2 workers)."""
    tree = image_tree(workdir, images)
    result = make_shards_measured(["shards.source=imagenet", f"shards.input={tree}"],
                                  workdir / f"tree-shards-{images}", images)
    return {"images": images, **result, "images_per_s": images / result["seconds"]}


def run_tree_listing(images: int, workdir: Path) -> dict[str, Any]:
    """Child process: the tree listed as (Path, label) pairs, the earlier source's way."""
    tree = image_tree(workdir, images)
    before = peak_rss_bytes()
    folders = sorted(p for p in tree.iterdir() if p.is_dir())
    items = [(path, label) for label, folder in enumerate(folders)
             for path in sorted(folder.iterdir())]
    return {"images": len(items), "listing_rss_mib": (peak_rss_bytes() - before) / 2**20}


def caption_shards(root: Path, rows: int) -> Path:
    """``rows`` samples in shards of ``SHARD``, 1 - ``DUPLICATES`` of the captions distinct."""
    from webdataset import TarWriter

    folder = root / f"caption-shards-{rows}"
    if (folder / "done").is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    distinct = int(rows * (1 - DUPLICATES))
    words = np.random.default_rng(rows).integers(0, len(WORDS), (distinct, 18))
    payload = io.BytesIO()
    Image.new("RGB", (16, 16), (120, 30, 200)).save(payload, format="JPEG")
    infos = []
    for s in range(rows // SHARD):
        path = folder / f"{s:05d}.tar"
        with TarWriter(str(path)) as writer:
            for i in range(s * SHARD, (s + 1) * SHARD):
                j = i % distinct
                caption = " ".join(WORDS[w] for w in words[j]) + f" {j}"
                writer.write({"__key__": f"{i:09d}", "jpg": payload.getvalue(), "txt": caption})
        infos.append(ShardInfo(path.name, SHARD, path.stat().st_size, file_sha256(path)))
    Manifest("captions", infos).write(folder)
    (folder / "done").write_text("")
    return folder


def graph_config(rows: int, workdir: Path) -> GraphConfig:
    """rows / 10,000 parts, one shard each, so a part's size is the same at every size."""
    return GraphConfig(shards=str(caption_shards(workdir, rows)),
                       output=str(workdir / f"store-{rows}"), num_parts=rows // SHARD)


def graph_args(rows: int, workdir: Path) -> list[str]:
    cfg = graph_config(rows, workdir)
    return [f"graph.shards={cfg.shards}", f"graph.output={cfg.output}",
            f"graph.num_parts={cfg.num_parts}"]


def collect_rest(rows: int, workdir: Path) -> dict[str, Any]:
    """Child process: collect parts 1.. (part 0 runs through the command, measured)."""
    from data_pipeline.graph.job import collect

    cfg = graph_config(rows, workdir)
    start = time.perf_counter()
    for part in range(1, cfg.num_parts):
        collect(cfg, part, cfg.num_parts)
    return {"rows": rows, "seconds": time.perf_counter() - start}


def stand_in_chunks(cfg: GraphConfig, distinct: int, skip_part: int) -> None:
    """The encoder's chunks of every part but ``skip_part`` as stand-ins for ``distinct``
    captions: unit vectors scattered around 2,000 random centres, clustered as caption
    embeddings are (the real model embeds ~75 captions/s on 2 cores: 1M captions would
    take ~3.7 h)."""
    from data_pipeline.graph.job import chunk_path
    from data_pipeline.graph.parts import finish

    gen = np.random.default_rng(0)
    centres = gen.normal(size=(2_000, 384)).astype(np.float32)
    chunk_path(cfg, 0).parent.mkdir(parents=True, exist_ok=True)
    for c in range((distinct + cfg.batch_size - 1) // cfg.batch_size):
        if c % cfg.num_parts == skip_part:
            continue
        n = min(cfg.batch_size, distinct - c * cfg.batch_size)
        vectors = centres[gen.integers(0, len(centres), n)] + gen.normal(
            scale=0.5, size=(n, 384)).astype(np.float32)
        np.save(chunk_path(cfg, c), (vectors / np.linalg.norm(vectors, axis=1,
                                                           keepdims=True)).astype(np.float16))
        finish([chunk_path(cfg, c)], {"rows": n, "truncated": 0})


def other_chunks(rows: int, workdir: Path) -> dict[str, Any]:
    """Child process: the chunks of parts 1.. as stand-ins (part 0's are real and
    measured)."""
    stand_in_chunks(graph_config(rows, workdir), int(rows * (1 - DUPLICATES)), skip_part=0)
    return {"rows": rows}


def all_captions(rows: int, workdir: Path) -> dict[str, Any]:
    """Child process: every part's keys and captions as Python lists and their distinct
    captions sorted: what each part's encode and the merge held before they streamed."""
    from data_pipeline.tario import iter_shard

    shards = caption_shards(workdir, rows)
    before = peak_rss_bytes()
    keys, captions = [], []
    for tar in sorted(shards.glob("*.tar")):
        for raw in iter_shard(str(tar)):
            keys.append(raw["__key__"])
            captions.append(raw["txt"].decode())
    distinct = sorted(set(captions))
    return {"rows": len(keys), "distinct": len(distinct),
            "all_captions_rss_mib": (peak_rss_bytes() - before) / 2**20}


def run_graph(rows: int, workdir: Path, child) -> dict[str, Any]:
    """graph-precompute of ``rows`` captions in rows / 10,000 parts: part 0's collect and
    encode and the merge through the real command, each measured."""
    args = graph_args(rows, workdir)
    collect = run_command("app.graph_precompute", [*args, "graph.phase=collect", "graph.part=0"])
    child("collect_rest", rows)
    encode = run_command("app.graph_precompute", [*args, "graph.phase=encode", "graph.part=0"])
    child("other_chunks", rows)
    merge = run_command("app.graph_precompute", [*args, "graph.phase=merge"])
    store_mib = sum(f.stat().st_size for f in (workdir / f"store-{rows}").glob("*.npy")) / 2**20
    # the same merge writing the centred store (graph.center): one more pass for the mean
    centred = run_command("app.graph_precompute", [*args, "graph.phase=merge",
                                                   "graph.center=true"])
    return {"rows": rows, "parts": rows // SHARD,
            "collect_s": collect["seconds"], "collect_rss_mib": collect["command_rss_mib"],
            "encode_s": encode["seconds"], "encode_rss_mib": encode["command_rss_mib"],
            "merge_s": merge["seconds"], "merge_rss_mib": merge["command_rss_mib"],
            "merge_center_s": centred["seconds"],
            "merge_center_rss_mib": centred["command_rss_mib"], "store_mib": store_mib}


def run_neighbours(rows: int, workdir: Path, where: str) -> dict[str, Any]:
    """Child process: the neighbour graph (inverted file of constant-size lists) of
    ``rows`` float16 embeddings, its probes and result in memory or (``where=scratch``)
    memory-mapped files, as graph-precompute runs it."""
    from data_pipeline.graph.inverted import inverted_topk
    from data_pipeline.graph.neighbours import recall

    path = workdir / f"embeddings-{rows}.npy"
    if not path.is_file():
        gen = np.random.default_rng(rows)
        centres = gen.normal(size=(2_000, 384)).astype(np.float32)
        store = np.lib.format.open_memmap(path, mode="w+", dtype=np.float16,
                                          shape=(rows, 384))
        for start in range(0, rows, 100_000):
            n = min(100_000, rows - start)
            block = centres[gen.integers(0, len(centres), n)] + gen.normal(
                scale=0.5, size=(n, 384)).astype(np.float32)
            store[start:start + n] = block / np.linalg.norm(block, axis=1, keepdims=True)
        store.flush()
        del store
    vectors = np.load(path, mmap_mode="r")
    scratch = workdir / f"scratch-{rows}" if where == "scratch" else None
    if scratch is not None:
        scratch.mkdir(exist_ok=True)
    start = time.perf_counter()
    with PeakAnonymous() as anonymous:
        _, ids, lists = inverted_topk(vectors, 10, scratch=scratch)
        seconds = time.perf_counter() - start
        measured = recall(vectors, ids)
    return {"rows": rows, "where": where, "seconds": seconds, "recall": measured,
            "lists": lists, "rss_mib": peak_rss_bytes() / 2**20,
            "anon_mib": anonymous.peak / 2**20, "store_mib": path.stat().st_size / 2**20}
