"""``graph-precompute`` task ``captions``: every sample's caption embedded once, keyed by
``__key__``.

Phases, each resumable from what it left on disk (validated by counts and checksums):

1. ``collect`` (part p of P): reads shards i with i % P == p, writes ``parts/captions-p.jsonl``
   of (key, caption); empty, missing and non-UTF-8 captions are counted, not written.
2. ``encode`` (part p of P): the distinct captions of all parts, sorted, cut into fixed
   chunks of ``batch_size``; part p embeds chunks c with c % P == p into ``chunks/``. The
   chunks do not depend on P, so 1 and N workers produce identical bytes.
3. ``merge``: assembles the store (``store.py``) and ``meta.json``.

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
from pathlib import Path

import numpy as np
from tqdm import tqdm

from data_pipeline.graph.config import GraphConfig
from data_pipeline.graph.encoder import encode, load_encoder
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


def _write_atomic(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as handle:
        write(handle)
    os.replace(tmp, path)


def _valid(data: Path) -> dict | None:
    """The sidecar of a finished file whose checksum still matches, else None."""
    try:
        info = json.loads(data.with_suffix(".json").read_text())
        return info if file_sha256(data) == info["sha256"] else None
    except (OSError, ValueError, KeyError):
        return None


def _finish(data: Path, info: dict) -> dict:
    info = info | {"sha256": file_sha256(data)}
    _write_atomic(data.with_suffix(".json"), lambda h: h.write(json.dumps(info).encode()))
    return info


def _part(cfg: GraphConfig, part: int) -> Path:
    return Path(cfg.output) / "parts" / f"captions-{part:05d}.jsonl"


def collect(cfg: GraphConfig, part: int, num_parts: int) -> dict:
    """Phase 1: this part's (key, caption) pairs."""
    path = _part(cfg, part)
    if (info := _valid(path)) is not None:
        return info
    path.parent.mkdir(parents=True, exist_ok=True)
    shards = ShardSet.open(cfg.shards)
    skipped: Counter[str] = Counter()
    lines = []
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
                lines.append(json.dumps([raw["__key__"], caption], ensure_ascii=False))
        except TruncatedShard:
            skipped["truncated_shard"] += 1
    text = "".join(line + "\n" for line in lines).encode("utf-8")
    _write_atomic(path, lambda h: h.write(text))
    return _finish(path, {"samples": len(lines), "skipped": dict(skipped)})


def collected(cfg: GraphConfig, num_parts: int) -> tuple[list[str], list[str], Counter]:
    """(keys, captions, skipped) of every part; fails naming a part that is not done."""
    keys, captions, skipped = [], [], Counter()
    for part in range(num_parts):
        path = _part(cfg, part)
        info = _valid(path)
        if info is None:
            raise RuntimeError(f"{path}: collect part {part} of {num_parts} is not finished "
                               f"(run graph.phase=collect graph.part={part})")
        for line in path.read_text(encoding="utf-8").splitlines():
            key, caption = json.loads(line)
            keys.append(key)
            captions.append(caption)
        skipped.update(info["skipped"])
    return keys, captions, skipped


def _chunk(cfg: GraphConfig, index: int) -> Path:
    return Path(cfg.output) / "chunks" / f"chunk-{index:07d}.npy"


def encode_part(cfg: GraphConfig, part: int, num_parts: int) -> int:
    """Phase 2: embed chunks c % num_parts == part of the sorted distinct captions; returns
    the number of chunks of all parts."""
    _, captions, _ = collected(cfg, num_parts)
    distinct = sorted(set(captions))
    size = cfg.batch_size
    mine = range(part, (len(distinct) + size - 1) // size, num_parts)
    todo = [c for c in mine if _valid(_chunk(cfg, c)) is None]
    total = sum(len(distinct[c * size:(c + 1) * size]) for c in mine)
    left = sum(len(distinct[c * size:(c + 1) * size]) for c in todo)
    bar = tqdm(total=total, initial=total - left, unit="caption", unit_scale=True,
               desc=f"graph-precompute encode part {part}/{num_parts}")
    if todo:
        model = load_encoder(cfg.model, cfg.device)
        _chunk(cfg, 0).parent.mkdir(parents=True, exist_ok=True)
    for c in todo:
        batch = distinct[c * size:(c + 1) * size]
        vectors, truncated = encode(model, batch, size)
        _write_atomic(_chunk(cfg, c), lambda h, v=vectors: np.save(h, v))
        _finish(_chunk(cfg, c), {"rows": len(batch), "truncated": truncated})
        bar.update(len(batch))
    bar.close()
    return (len(distinct) + size - 1) // size


def merge(cfg: GraphConfig, num_parts: int) -> CaptionStore:
    """Phase 3: write the store from all parts and chunks."""
    keys, captions, skipped = collected(cfg, num_parts)
    distinct = sorted(set(captions))
    row_of = {caption: i for i, caption in enumerate(distinct)}
    chunks, truncated = [], 0
    for c in range((len(distinct) + cfg.batch_size - 1) // cfg.batch_size):
        info = _valid(_chunk(cfg, c))
        if info is None:
            raise RuntimeError(f"{_chunk(cfg, c)}: missing or corrupt; run graph.phase=encode")
        chunks.append(np.load(_chunk(cfg, c)))
        truncated += info["truncated"]
    embeddings = np.concatenate(chunks) if chunks else np.zeros((0, 384), np.float16)
    encoded = np.array([k.encode() for k in keys])
    order = np.argsort(encoded, kind="stable")
    sorted_keys = encoded[order]
    if len(sorted_keys) > 1 and (same := np.flatnonzero(sorted_keys[1:] == sorted_keys[:-1])).size:
        raise ValueError(f"{cfg.shards}: key {sorted_keys[same[0]].decode()} occurs twice")
    rows = np.array([row_of[captions[i]] for i in order], dtype=np.int32)
    out = Path(cfg.output)
    files = {"keys.npy": sorted_keys, "rows.npy": rows, "embeddings.npy": embeddings}
    for name, array in files.items():
        _write_atomic(out / name, lambda h, a=array: np.save(h, a))
    text = "".join(json.dumps(c, ensure_ascii=False) + "\n" for c in distinct).encode("utf-8")
    _write_atomic(out / "captions.jsonl", lambda h: h.write(text))
    meta = {
        "model": cfg.model, "dim": int(embeddings.shape[1]), "num_keys": len(keys),
        "num_unique": len(distinct), "duplicate_rate": 1 - len(distinct) / max(len(keys), 1),
        "truncated": truncated, "skipped": dict(skipped), "shards": str(cfg.shards),
        "sha256": {name: file_sha256(out / name) for name in files},
    }
    _write_atomic(out / "meta.json", lambda h: h.write(json.dumps(meta, indent=1).encode()))
    return CaptionStore.open(out)


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
    wait_for([_part(cfg, p) for p in range(num_parts)], "collect")
    chunks = encode_part(cfg, part, num_parts)
    if part != 0:
        return None
    wait_for([_chunk(cfg, c) for c in range(chunks)], "encode")
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
