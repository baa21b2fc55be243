"""Reading and writing WebDataset tar shards (the layout img2dataset writes).

A sample is the run of consecutive members sharing a key: ``<key>.jpg``, ``<key>.cls``,
``<key>.txt``, ``<key>.json``. Writing is deterministic (fixed headers), so the same samples
give byte-identical shards and checksums.
"""

from __future__ import annotations

import io
import os
import tarfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from data_pipeline.sources import Sample


class TruncatedShard(Exception):
    """The tar ended inside a member or its headers are corrupt."""


def _member(name: str, data: bytes) -> tuple[tarfile.TarInfo, io.BytesIO]:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), 0, 0o444
    info.uname = info.gname = ""
    return info, io.BytesIO(data)


def write_shard(path: Path, samples: Iterable[Sample]) -> int:
    """Write ``samples`` to ``path`` atomically (temporary file, then rename); returns count."""
    tmp = path.with_name(path.name + ".tmp")
    count = 0
    with tarfile.open(tmp, "w", format=tarfile.USTAR_FORMAT) as tar:
        for sample in samples:
            tar.addfile(*_member(f"{sample.key}.{sample.ext}", sample.image))
            if sample.label is not None:
                tar.addfile(*_member(f"{sample.key}.cls", str(sample.label).encode()))
            if sample.caption is not None:
                tar.addfile(*_member(f"{sample.key}.txt", sample.caption.encode("utf-8")))
            count += 1
    os.replace(tmp, path)
    return count


def iter_shard(path: str | Path) -> Iterator[dict[str, bytes | str]]:
    """Yield ``{"__key__": key, ext: bytes, ...}`` per sample; raise TruncatedShard at a
    broken tail after yielding every complete sample before it."""
    current: dict[str, bytes | str] = {}
    try:
        with tarfile.open(path, "r|") as tar:
            for member in tar:
                if not member.isfile():
                    continue
                base = os.path.basename(member.name)
                key, _, ext = base.partition(".")
                prefix = os.path.dirname(member.name)
                key = f"{prefix}/{key}" if prefix else key
                handle = tar.extractfile(member)
                data = handle.read() if handle else b""
                if len(data) != member.size:
                    raise TruncatedShard(f"{path}: member {member.name} is cut short")
                if current and current["__key__"] != key:
                    yield current
                    current = {}
                current["__key__"] = key
                current[ext.lower()] = data
    except (tarfile.ReadError, EOFError, OSError) as err:
        raise TruncatedShard(f"{path}: {err}") from None
    if current:
        yield current
