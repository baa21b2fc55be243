"""``graph-precompute`` task ``captions``: every sample's caption embedded once, keyed by
``__key__``.

Phases, each resumable from what it left on disk (validated by counts and checksums):

1. ``collect`` (part p of P): reads shards i with i % P == p, writes its (key, caption)
   pairs sorted by caption and by key (``parts.py``); empty, missing and non-UTF-8
   captions are counted, not written.
2. ``encode`` (part p of P): the distinct captions of all parts, streamed in sorted order
   from the parts' files, cut into fixed chunks of ``batch_size``; part p embeds chunks c
   with c % P == p into ``chunks/``. The chunks do not depend on P, so 1 and N workers
   produce identical bytes.
3. ``merge``: streams the store (``store.py``) and ``meta.json`` out of the parts and chunks.

No phase holds more than one part's pairs in memory.

``phase=all`` runs the three in order; under torchrun every rank is one part. The ranks
meet through the files the phases write, not through collectives: a rank that finished a
phase polls for the other parts' sidecars (logging what it waits for every minute), so a
slow part (a large shard, a slow encoder) never trips a collective's timeout; rank 0 merges
once every chunk is there, the others end after their encode. (A slurm array instead runs
each phase per task with ``graph.part``/``graph.num_parts``, then one merge.)
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from tqdm import tqdm

from data_pipeline.graph.config import GraphConfig
from data_pipeline.graph.encoder import encode, load_encoder
from data_pipeline.graph.parts import (
    NpyWriter,
    PartFiles,
    distinct_captions,
    finish,
    merged_captions,
    merged_keys,
    part_block,
    valid,
    write_atomic,
    write_part,
)
from data_pipeline.graph.store import CaptionStore
from data_pipeline.manifest import file_sha256
from data_pipeline.shards import ShardSet
from data_pipeline.tario import TruncatedShard, iter_shard

log = logging.getLogger(__name__)


def part_of(cfg: GraphConfig) -> tuple[int, int]:
    """(part, number of parts): from the config, else torchrun's RANK/WORLD_SIZE, else (0, 1)."""
    if cfg.num_parts is not None:
        return cfg.part or 0, cfg.num_parts
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def _parts(cfg: GraphConfig, num_parts: int) -> list[PartFiles]:
    return [_part_files(cfg, p) for p in range(num_parts)]


def _part_files(cfg: GraphConfig, part: int) -> PartFiles:
    return PartFiles.of(Path(cfg.output) / "parts", part)


def collect(cfg: GraphConfig, part: int, num_parts: int) -> dict:
    """Phase 1: this part's (key, caption) pairs, sorted (``parts.py``)."""
    files = _part_files(cfg, part)
    if (info := valid(files.captions)) is not None:
        return info
    files.captions.parent.mkdir(parents=True, exist_ok=True)
    shards = ShardSet.open(cfg.shards)
    skipped: Counter[str] = Counter()
    pairs = []
    for url in shards.urls[part::num_parts]:
        try:
            for raw in iter_shard(url):
                if "txt" not in raw:
                    skipped["missing_caption"] += 1
                    continue
                try:
                    caption = raw["txt"].decode("utf-8").strip()
                except UnicodeDecodeError:
                    skipped["non_utf8_caption"] += 1
                    continue
                if not caption:
                    skipped["empty_caption"] += 1
                    continue
                pairs.append((raw["__key__"], caption))
        except TruncatedShard:
            skipped["truncated_shard"] += 1
    return write_part(files, pairs, {"skipped": dict(skipped)})


def collected(cfg: GraphConfig, num_parts: int) -> list[dict]:
    """The sidecar of every collect part; fails naming a part that is not done."""
    infos = []
    for part, files in enumerate(_parts(cfg, num_parts)):
        if (info := valid(files.captions)) is None:
            raise RuntimeError(f"{files.captions}: collect part {part} of {num_parts} is not "
                               f"finished (run graph.phase=collect graph.part={part})")
        infos.append(info)
    return infos


def chunk_path(cfg: GraphConfig, index: int) -> Path:
    return Path(cfg.output) / "chunks" / f"chunk-{index:07d}.npy"


def _chunks_of(captions: Iterator[str], size: int) -> Iterator[list[str]]:
    """Consecutive runs of ``size`` captions (the last one shorter)."""
    batch: list[str] = []
    for caption in captions:
        batch.append(caption)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def caption_batches(cfg: GraphConfig, num_parts: int) -> Iterator[list[str]]:
    """The encoder's batches: the sorted distinct captions of all parts in runs of
    ``batch_size``. They depend on the captions alone, not on ``num_parts``, so every
    caption is encoded beside the same neighbours however the work is split."""
    return _chunks_of(distinct_captions(_parts(cfg, num_parts)), cfg.batch_size)


def encode_part(cfg: GraphConfig, part: int, num_parts: int) -> int:
    """Phase 2: embed chunks c % num_parts == part of :func:`caption_batches`, streamed
    from the parts' sorted files; returns the number of chunks of all parts."""
    infos = collected(cfg, num_parts)
    bar = tqdm(total=sum(i["samples"] for i in infos), unit="caption", unit_scale=True,
               desc=f"graph-precompute encode part {part}/{num_parts} (captions streamed)")
    model, chunks = None, 0
    for c, batch in enumerate(caption_batches(cfg, num_parts)):
        chunks = c + 1
        bar.update(len(batch))
        if c % num_parts != part or valid(chunk_path(cfg, c)) is not None:
            continue
        if model is None:
            model = load_encoder(cfg.model, cfg.device)
            chunk_path(cfg, 0).parent.mkdir(parents=True, exist_ok=True)
        vectors, truncated = encode(model, batch, cfg.batch_size)
        write_atomic(chunk_path(cfg, c), lambda h, v=vectors: np.save(h, v))
        finish([chunk_path(cfg, c)], {"rows": len(batch), "truncated": truncated})
    bar.close()
    return chunks


def merge(cfg: GraphConfig, num_parts: int) -> CaptionStore:
    """Phase 3: write the store from all parts and chunks (``store.py``), streaming."""
    infos = collected(cfg, num_parts)
    parts, out = _parts(cfg, num_parts), Path(cfg.output)
    part_rows = [NpyWriter(p.rows, (i["samples"],), np.int32, part_block(len(parts)))
                 for p, i in zip(parts, infos, strict=True)]
    unique, previous = -1, None
    with open(out / "captions.jsonl.tmp", "wb") as text:
        for caption, part in merged_captions(parts):
            if caption != previous:
                unique, previous = unique + 1, caption
                text.write((json.dumps(caption, ensure_ascii=False) + "\n").encode("utf-8"))
            part_rows[part].add(unique)
    os.replace(out / "captions.jsonl.tmp", out / "captions.jsonl")
    for writer in part_rows:
        writer.close()
    num_unique, num_keys = unique + 1, sum(i["samples"] for i in infos)
    mean = _mean_caption(cfg, parts, num_unique) if cfg.center else None
    dim, truncated = _write_embeddings(cfg, num_unique, out / "embeddings.npy", mean)
    _write_key_index(cfg, parts, infos, out)
    skipped = sum((Counter(i["skipped"]) for i in infos), Counter())
    files = ["keys.npy", "rows.npy", "embeddings.npy"]
    meta = {
        "model": cfg.model, "dim": dim, "num_keys": num_keys, "num_unique": num_unique,
        "duplicate_rate": 1 - num_unique / max(num_keys, 1), "truncated": truncated,
        "skipped": dict(skipped), "shards": str(cfg.shards), "center": cfg.center,
        "sha256": {name: file_sha256(out / name) for name in files},
    }
    write_atomic(out / "meta.json", lambda h: h.write(json.dumps(meta, indent=1).encode()))
    return CaptionStore.open(out)


def _chunk_infos(cfg: GraphConfig, num_unique: int) -> list[dict]:
    """The encode phase's chunk sidecars, in row order; fails naming a missing chunk."""
    size = cfg.batch_size
    infos = [valid(chunk_path(cfg, c)) for c in range((num_unique + size - 1) // size)]
    if (missing := next((c for c, i in enumerate(infos) if i is None), None)) is not None:
        raise RuntimeError(f"{chunk_path(cfg, missing)}: missing or corrupt; "
                           "run graph.phase=encode")
    return infos


def _mean_caption(cfg: GraphConfig, parts: list[PartFiles], num_unique: int) -> np.ndarray:
    """[dim] float64: the mean of the samples' unit caption embeddings, each distinct
    caption weighted by how many samples carry it (``graph.center``). Streams the parts'
    rows and the chunks once: O(samples + distinct captions x dim), [U] counts held."""
    counts = np.zeros(num_unique, np.int64)
    for part in parts:
        rows = np.load(part.rows, mmap_mode="r")
        for start in range(0, len(rows), 1 << 22):
            counts += np.bincount(rows[start:start + (1 << 22)], minlength=num_unique)
    total, start = None, 0
    for c in range(len(_chunk_infos(cfg, num_unique))):
        chunk = _unit(np.load(chunk_path(cfg, c)).astype(np.float64))
        weighted = counts[start:start + len(chunk)] @ chunk
        total = weighted if total is None else total + weighted
        start += len(chunk)
    return total / max(int(counts.sum()), 1) if total is not None else np.zeros(0)


def _unit(rows: np.ndarray) -> np.ndarray:
    """Each row over its norm (a zero row stays zero)."""
    norms = np.linalg.norm(rows, axis=1, keepdims=True)
    return rows / np.maximum(norms, 1e-12)


def _write_embeddings(cfg: GraphConfig, num_unique: int, path: Path,
                      mean: np.ndarray | None = None) -> tuple[int, int]:
    """Concatenate the chunks into ``path`` [U, dim] float16; (dim, truncated captions).
    With ``mean`` (``graph.center``) each row is written as unit(unit(e) - mean)."""
    infos = _chunk_infos(cfg, num_unique)
    dim = np.load(chunk_path(cfg, 0), mmap_mode="r").shape[1] if infos else 384
    embeddings = NpyWriter(path, (num_unique, dim), np.float16)
    for c in range(len(infos)):
        chunk = np.load(chunk_path(cfg, c))
        if mean is not None:
            chunk = _unit(_unit(chunk.astype(np.float64)) - mean).astype(np.float16)
        embeddings.write(chunk)
    embeddings.close()
    return dim, sum(i["truncated"] for i in infos)


def _write_key_index(cfg: GraphConfig, parts: list[PartFiles], infos: list[dict],
                     out: Path) -> None:
    """``keys.npy`` (every key, sorted) and ``rows.npy`` (its embedding row), streamed from
    the parts' sorted keys; a key in two samples fails naming it."""
    num_keys = sum(i["samples"] for i in infos)
    width = max((i["key_width"] for i in infos), default=1)
    keys = NpyWriter(out / "keys.npy", (num_keys,), f"S{width}")
    rows = NpyWriter(out / "rows.npy", (num_keys,), np.int32)
    previous = None
    for key, row in merged_keys(parts):
        if key == previous:
            raise ValueError(f"{cfg.shards}: key {key.decode()} occurs twice")
        previous = key
        keys.add(key)
        rows.add(row)
    keys.close()
    rows.close()


def run_captions(cfg: GraphConfig) -> CaptionStore | None:
    part, num_parts = part_of(cfg)
    if cfg.phase == "collect":
        collect(cfg, part, num_parts)
    elif cfg.phase == "encode":
        encode_part(cfg, part, num_parts)
    elif cfg.phase == "merge":
        return merge(cfg, num_parts)
    elif num_parts == 1:
        collect(cfg, 0, 1)
        encode_part(cfg, 0, 1)
        return merge(cfg, 1)
    else:
        return _run_ranks(cfg, part, num_parts)
    return None


def _run_ranks(cfg: GraphConfig, part: int, num_parts: int) -> CaptionStore | None:
    """All phases across torchrun ranks, one part each, rank 0 merging."""
    collect(cfg, part, num_parts)
    wait_for([p.captions for p in _parts(cfg, num_parts)], "collect")
    chunks = encode_part(cfg, part, num_parts)
    if part != 0:
        return None
    wait_for([chunk_path(cfg, c) for c in range(chunks)], "encode")
    return merge(cfg, num_parts)


def wait_for(paths: list[Path], phase: str, poll: float = 1.0, report: float = 60.0) -> None:
    """Return once every one of ``paths`` has its sidecar (written last, atomically, when
    the file is finished); log what is still missing every ``report`` seconds."""
    waited = 0.0
    while missing := [p for p in paths if not p.with_suffix(".json").is_file()]:
        if waited >= report:
            log.info("graph-precompute: waiting for %d of %d %s files (%s, ...)",
                     len(missing), len(paths), phase, missing[0])
            waited = 0.0
        time.sleep(poll)
        waited += poll
