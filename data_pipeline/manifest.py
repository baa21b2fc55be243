"""The shard manifest: names, sample counts, checksums, class names, totals (docs/data_pipeline.md).

A loader refuses shards that disagree with their manifest before any work starts.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import BinaryIO

from core.errors import RunError

MANIFEST = "manifest.json"


class ManifestError(RunError, ValueError):
    """The manifest or a shard it lists is missing, malformed or does not match."""


@dataclass
class ShardInfo:
    name: str  # file name relative to the manifest's directory
    samples: int
    bytes: int
    sha256: str


@dataclass
class Manifest:
    source: str
    shards: list[ShardInfo]
    class_names: list[str] = field(default_factory=list)
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> count, at ingestion

    @property
    def total_samples(self) -> int:
        return sum(s.samples for s in self.shards)

    def write(self, directory: Path) -> Path:
        payload = asdict(self) | {"total_samples": self.total_samples,
                                  "num_shards": len(self.shards)}
        path = Path(directory) / MANIFEST
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(payload, indent=1))
        os.replace(tmp, path)
        return path

    @classmethod
    def read(cls, directory: str | Path) -> Manifest:
        path = Path(directory) / MANIFEST
        if not path.is_file():
            raise ManifestError(f"{path}: no manifest (run make-shards first)")
        return cls.parse(path.read_text(), str(path))

    @classmethod
    def parse(cls, text: str, where: str) -> Manifest:
        """A manifest from its JSON ``text``; errors name ``where`` it came from. Every
        shard name must be a plain file name inside the manifest's folder
        (:func:`check_shard_name`), checked before anything is read."""
        try:
            raw = json.loads(text)
            shards = [ShardInfo(**s) for s in raw["shards"]]
            manifest = cls(source=raw["source"], shards=shards,
                           class_names=list(raw.get("class_names", [])),
                           skipped=dict(raw.get("skipped", {})))
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise ManifestError(f"{where}: malformed manifest: {err}") from None
        for shard in manifest.shards:
            check_shard_name(shard.name, where)
        return manifest

    def verify(self, directory: str | Path, checksums: bool = False) -> None:
        """Fail naming the shard if a file is missing or its size (or hash) differs."""
        directory = Path(directory)
        for shard in self.shards:
            path = directory / shard.name
            if not path.is_file():
                raise ManifestError(f"{path}: listed in {directory / MANIFEST} but missing")
            size = path.stat().st_size
            if size != shard.bytes:
                raise ManifestError(f"{path}: {size} bytes, the manifest says {shard.bytes}")
            if checksums and file_sha256(path) != shard.sha256:
                raise ManifestError(f"{path}: checksum differs from {directory / MANIFEST}")


def check_shard_name(name: object, where: str) -> None:
    """ManifestError unless ``name`` is a plain file name: no separator, no scheme or
    ``pipe:`` command, not ``.`` or ``..``, no control character, no leading ``-``. A
    manifest comes from whoever wrote the folder; its names are joined to the folder and
    handed to webdataset, which would run a ``pipe:`` name as a shell command."""
    text = str(name)
    if (not isinstance(name, str) or not text or text in (".", "..")
            or any(c in text for c in "/\\:") or text.startswith("-")
            or any(ord(c) < 32 or ord(c) == 127 for c in text)):
        raise ManifestError(f"{where}: shard name {text[:80]!r} is not a plain file name "
                            "inside the manifest's folder (no '/', '\\', ':', '..' or "
                            "control characters); refusing the manifest")


class HashingReader:
    """A binary stream that hashes (SHA-256) every byte read through it, so a file can be
    parsed and checksummed in one read; ``drain`` reads what the parser left."""

    def __init__(self, raw: BinaryIO) -> None:
        self.raw, self.digest = raw, hashlib.sha256()

    def read(self, size: int = -1) -> bytes:
        data = self.raw.read(size)
        self.digest.update(data)
        return data

    def drain(self) -> str:
        """Read to the end; the hex digest of the whole stream."""
        while self.read(1 << 20):
            pass
        return self.digest.hexdigest()


def file_sha256(path: str | Path) -> str:
    with open(path, "rb") as handle:
        return HashingReader(handle).drain()
