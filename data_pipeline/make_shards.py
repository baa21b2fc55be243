"""Write WebDataset shards and their manifest (the ``make-shards`` stage).

The source's samples are written in a seeded random order (``shards.shuffle``, on by
default): shard i holds items [i * shard_size, (i + 1) * shard_size) of a permutation of the
source drawn from ``shards.seed``, so a source listed class by class (an image tree) gives
shards that each hold every class. A pool of ``shards.workers`` spawned processes writes
them (this process alone where one would). Each finished shard leaves a sidecar
``shard-XXXXXX.json`` (count, bytes, checksum, skipped samples); a re-run skips shards whose
sidecar matches the file, so an interrupted job resumes and ends with the same manifest.
img2dataset output is indexed where it lies, never rewritten.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
from collections import Counter
from collections.abc import Iterator
from contextlib import nullcontext
from pathlib import Path

import numpy as np
from tqdm import tqdm

from data_pipeline.config import ShardsConfig
from data_pipeline.formats import Sample, SkipSample, image_of
from data_pipeline.manifest import HashingReader, Manifest, ShardInfo, file_sha256
from data_pipeline.sources import build_source, source_spec
from data_pipeline.tario import TruncatedShard, iter_stream, write_shard

_SOURCE = None  # the source, set once per worker process


def _init_worker(source: object) -> None:
    global _SOURCE
    _SOURCE = source


def _sidecar(path: Path) -> Path:
    return path.with_suffix(".json")


def _finished(path: Path) -> dict | None:
    """The sidecar of a completed shard, or None when the shard must be (re)written."""
    try:
        info = json.loads(_sidecar(path).read_text())
        return info if path.stat().st_size == info["bytes"] else None
    except (OSError, ValueError, KeyError):
        return None


def _write_one(job: tuple[Path, np.ndarray]) -> dict:
    return _write_shard(_SOURCE, *job)


def _write_shard(source: object, path: Path, items: np.ndarray) -> dict:
    skipped: Counter[str] = Counter()

    def samples() -> Iterator[Sample]:
        for i in items.tolist():
            try:
                yield source.load(i)
            except SkipSample as skip:
                skipped[skip.reason] += 1

    count = write_shard(path, samples())
    info = {"name": path.name, "samples": count, "bytes": path.stat().st_size,
            "sha256": file_sha256(path), "skipped": dict(skipped)}
    tmp = _sidecar(path).with_suffix(".json.tmp")
    tmp.write_text(json.dumps(info))
    os.replace(tmp, _sidecar(path))
    return info


def sample_order(total: int, seed: int, shuffle: bool = True) -> np.ndarray:
    """The source items in the order make-shards writes them: shard i holds items
    ``order[i * shard_size:(i + 1) * shard_size]``."""
    return np.random.default_rng(seed).permutation(total) if shuffle else np.arange(total)


def _written(source: object, jobs: list[tuple[Path, np.ndarray]],
             processes: int) -> Iterator[dict]:
    """Each job's shard written, as it finishes: by ``processes`` spawned processes, or by
    this one when one process would write them all (a spawned interpreter pays seconds of
    imports before its first sample)."""
    if processes <= 1:
        yield from (_write_shard(source, *job) for job in jobs)
        return
    with mp.get_context("spawn").Pool(processes, initializer=_init_worker,
                                      initargs=(source,)) as pool:
        yield from pool.imap_unordered(_write_one, jobs)


def write_source_shards(cfg: ShardsConfig) -> Manifest:
    """Cut the configured source into shards under ``cfg.output`` and write the manifest."""
    source = build_source(cfg)  # a source that cannot be read fails before any output
    out = Path(cfg.output)
    out.mkdir(parents=True, exist_ok=True)
    total = len(source)
    paths = [out / f"shard-{i:06d}.tar" for i in range((total + cfg.shard_size - 1)
                                                        // cfg.shard_size)]
    infos = {p: _finished(p) for p in paths}
    order = sample_order(total, cfg.seed, cfg.shuffle)
    jobs = [(p, order[i * cfg.shard_size:(i + 1) * cfg.shard_size])
            for i, p in enumerate(paths) if infos[p] is None]
    bar = tqdm(total=len(paths), initial=len(paths) - len(jobs), unit="shard",
               desc=f"make-shards {cfg.source}")
    for info in _written(source, jobs, min(cfg.workers, len(jobs))):
        infos[out / info["name"]] = info
        bar.update()
    bar.close()
    skipped: Counter[str] = Counter()
    shards = []
    for path in paths:
        info = infos[path]
        skipped.update(info["skipped"])
        shards.append(ShardInfo(info["name"], info["samples"], info["bytes"], info["sha256"]))
    manifest = Manifest(source=cfg.source, shards=shards, class_names=source.class_names,
                        skipped=dict(skipped))
    manifest.write(out)
    return manifest


def img2dataset_failures(root: Path) -> Counter[str]:
    """Samples img2dataset could not fetch or resize (they are absent from its shards),
    from its per-shard ``*_stats.json``."""
    failed: Counter[str] = Counter()
    for stats in sorted(root.glob("*_stats.json")):
        record = json.loads(stats.read_text())
        failed["failed_download"] += int(record.get("failed_to_download", 0))
        failed["failed_resize"] += int(record.get("failed_to_resize", 0))
    return +failed


def _index_tar(tar: Path) -> tuple[ShardInfo, dict[str, int]]:
    """One img2dataset tar's samples counted and its checksum taken in the same read."""
    skipped: Counter[str] = Counter()
    count = 0
    with open(tar, "rb") as raw:
        stream = HashingReader(raw)
        try:
            for sample in iter_stream(stream, str(tar)):
                if image_of(sample):
                    count += 1
                else:
                    skipped["missing_image"] += 1
        except TruncatedShard:
            skipped["truncated_shard"] += 1
        digest = stream.drain()
    return ShardInfo(tar.name, count, tar.stat().st_size, digest), dict(skipped)


def index_img2dataset(cfg: ShardsConfig) -> Manifest:
    """Validate img2dataset's shards in place, ``cfg.workers`` tars at a time, and write a
    manifest that lists them; in another output folder each tar is a link there, so the
    manifest names only plain files of its own folder."""
    root = Path(cfg.input)
    tars = sorted(root.glob("*.tar"))
    if not tars:
        raise FileNotFoundError(f"img2dataset output {root}: no .tar shards")
    out = Path(cfg.output)
    out.mkdir(parents=True, exist_ok=True)
    skipped = img2dataset_failures(root)
    workers = min(cfg.workers, len(tars))
    with mp.get_context("spawn").Pool(workers) if workers > 1 else nullcontext() as pool:
        indexed = pool.imap(_index_tar, tars) if pool else map(_index_tar, tars)
        shards = []
        for info, tar_skipped in tqdm(indexed, total=len(tars), unit="shard",
                                      desc="index img2dataset"):
            shards.append(info)
            skipped.update(tar_skipped)
    if out.resolve() != root.resolve():  # the manifest names plain files of its folder
        for tar in tars:
            link = out / tar.name
            link.unlink(missing_ok=True)
            link.symlink_to(tar.resolve())
    manifest = Manifest(source="img2dataset", shards=shards, skipped=dict(+skipped))
    manifest.write(out)
    return manifest


def make_shards(cfg: ShardsConfig) -> Manifest:
    if source_spec(cfg.source).build is None:  # shards that are there: indexed in place
        return index_img2dataset(cfg)
    return write_source_shards(cfg)
