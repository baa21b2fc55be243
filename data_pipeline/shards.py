"""Which shards a ``data.shards`` / ``eval.*_shards`` / ``graph.shards`` value names, and how
many samples each holds.

Accepted forms (as webdataset and open_clip users write them):

- a local directory holding ``manifest.json`` (``make-shards`` output);
- a brace list or single URL: ``/data/cc3m/{00000..00331}.tar``,
  ``https://host/cc3m/{00000..00331}.tar``, ``pipe:curl -s https://host/{0..9}.tar``,
  ``gs://bucket/cc12m/{00000..01242}.tar``, ``s3://bucket/cc12m/{00000..01242}.tar``;
  several patterns join with ``::``.

A URL list needs no manifest. Sample counts come, in order of preference, from a
``manifest.json`` beside the shards (also giving class names), else from a per-machine
cache, ``$XDG_CACHE_HOME/contrastive-pretrain/shard-counts.json`` (delete it after a shard
changes), filled on first sight from img2dataset's ``<shard>_stats.json`` (``successes``)
or, without one, from a counting pass.
"""

from __future__ import annotations

import json
import os
import posixpath
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from data_pipeline.manifest import MANIFEST, Manifest, ManifestError
from data_pipeline.tario import (
    DEFAULT_RETRY,
    Retry,
    TruncatedShard,
    is_remote,
    iter_shard,
    open_url,
)


@dataclass
class ShardSet:
    """The shards to read, their sample counts and the class names (empty: unlabelled)."""

    urls: list[str]  # local paths or URLs
    counts: list[int]
    class_names: list[str]
    checksums: list[str] = field(default_factory=list)  # SHA-256 per shard ("": unknown)

    @classmethod
    def open(cls, spec: str | Path, verify_checksums: bool = False,
             retry: Retry = DEFAULT_RETRY) -> ShardSet:
        """The shards of ``spec``; a local manifest is verified against the files."""
        spec = str(spec)
        if is_folder(spec):
            manifest = Manifest.read(spec)
            manifest.verify(spec, checksums=verify_checksums)
            folder = os.path.abspath(spec)  # a joined name never reads as a scheme
            return cls([os.path.join(folder, s.name) for s in manifest.shards],
                       [s.samples for s in manifest.shards], manifest.class_names)
        urls = expand(spec)
        manifest = _manifest_beside(urls)
        if manifest is not None:
            listed = {s.name: s.samples for s in manifest.shards}
            if all(_name(url) in listed for url in urls):
                digests = {s.name: s.sha256 for s in manifest.shards}
                return cls(urls, [listed[_name(url)] for url in urls], manifest.class_names,
                           [digests[_name(url)] for url in urls])
        return cls(urls, sample_counts(urls, retry), [])

    @staticmethod
    def class_names_of(spec: str | Path) -> list[str]:
        """The class names of ``spec`` from its manifest alone (no counting pass); empty
        for a list with no manifest beside it."""
        spec = str(spec)
        if is_folder(spec):
            return Manifest.read(spec).class_names
        manifest = _manifest_beside(expand(spec))
        return [] if manifest is None else manifest.class_names

    @property
    def names(self) -> list[str]:
        """Each shard's file name, for messages and skip accounting."""
        return [_name(url) for url in self.urls]

    @property
    def total(self) -> int:
        return sum(self.counts)


def is_folder(spec: str | Path) -> bool:
    """A ``make-shards`` folder (read through its manifest), not a list of shard URLs."""
    spec = str(spec)
    listed = is_remote(spec) or "{" in spec or "::" in spec or spec.endswith(".tar")
    return os.path.isdir(spec) or not listed


def _name(url: str) -> str:
    return posixpath.basename(url.split("?")[0]) or url


def expand(spec: str) -> list[str]:
    """Brace expansion (and ``::`` joins) with webdataset's own shard-list code."""
    from webdataset.shardlists import expand_urls

    urls = expand_urls(spec)
    if not urls:
        raise ManifestError(f"{spec}: names no shards")
    return urls


def _fetch(url: str) -> bytes | None:
    """The bytes at ``url`` (a local path or URL), or None when it is not there."""
    if not is_remote(url):
        return Path(url).read_bytes() if os.path.isfile(url) else None
    if url.startswith("pipe:"):
        return None  # a command's siblings cannot be named
    try:
        stream = open_url(url)
        try:
            return stream.read()
        finally:
            stream.close()
    except OSError:
        return None


def _manifest_beside(urls: list[str]) -> Manifest | None:
    folder = posixpath.dirname(urls[0])
    if not folder or any(posixpath.dirname(url) != folder for url in urls):
        return None
    text = _fetch(f"{folder}/{MANIFEST}")
    return None if text is None else Manifest.parse(text.decode(), f"{folder}/{MANIFEST}")


def _stats_count(url: str) -> int | None:
    """img2dataset's ``<shard>_stats.json`` ``successes`` (the samples the tar holds)."""
    if not url.endswith(".tar"):
        return None
    text = _fetch(url[: -len(".tar")] + "_stats.json")
    if text is None:
        return None
    try:
        return int(json.loads(text)["successes"])
    except (ValueError, KeyError, TypeError):
        return None


def _count(url: str, retry: Retry) -> int:
    """Samples in the shard (up to a broken tail: the reader reports the tail)."""
    count = 0
    try:
        for _ in iter_shard(url, retry):
            count += 1
    except TruncatedShard:
        pass
    return count


def cache_path() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(root) / "contrastive-pretrain" / "shard-counts.json"


def sample_counts(urls: list[str], retry: Retry = DEFAULT_RETRY) -> list[int]:
    """Samples per shard: the cache, else img2dataset's stats, else a counting pass. What
    was fetched or counted joins the cache, so a shard costs one request per machine, not
    one per open (a run opens its shard list several times per rank)."""
    path = cache_path()
    cached = json.loads(path.read_text()) if path.is_file() else {}
    found: dict[str, int] = {}
    missing = [url for url in urls if url not in cached]
    for url in tqdm(missing, desc="shard sizes", unit="shard", disable=len(missing) < 8):
        count = _stats_count(url)
        found[url] = count if count is not None else _count(url, retry)
    counts = [found[url] if url in found else cached[url] for url in urls]
    if found:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({**cached, **found}, indent=0, sort_keys=True))
        os.replace(tmp, path)
    return counts
