"""Reading and writing WebDataset tar shards (the layout img2dataset writes), through the
webdataset library: its URL opening (``gopen``: local paths, ``http(s)://`` via curl,
``pipe:`` commands, ``gs://`` via gsutil), its tar iteration and key grouping, its writer.

A sample is the run of consecutive members sharing a key: ``<key>.jpg``, ``<key>.cls``,
``<key>.txt``, ``<key>.json``. ``s3://`` URLs are read as open_clip reads them, through
``pipe:aws s3 cp <url> -``. A remote read that fails (connection refused, cut mid-shard)
is retried with exponential backoff and resumes after the last sample it delivered, so the
samples a reader yields do not depend on the failures; a source that stays down raises
:class:`ShardUnreachable` naming the URL. Writing is deterministic (fixed headers), so the
same samples give byte-identical shards and checksums.
"""

from __future__ import annotations

import logging
import os
import re
import tarfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO

from core.errors import RunError, first_line
from data_pipeline.config import Retry
from data_pipeline.formats import Sample

log = logging.getLogger(__name__)
REMOTE = ("http://", "https://", "pipe:", "s3://", "gs://")
META = re.compile(r"__[^/]*__($|/)")  # webdataset's skip_meta


class TruncatedShard(Exception):
    """The tar ended inside a member or its headers are corrupt."""


class ChecksumMismatch(Exception):
    """A shard whose bytes differ from the checksum its manifest records."""


class ShardUnreachable(RunError):
    """A remote shard that could not be read after every retry."""


DEFAULT_RETRY = Retry()


def is_remote(url: str) -> bool:
    return url.startswith(REMOTE)


def open_url(url: str) -> IO[bytes]:
    """A byte stream of ``url`` (a local path or any scheme above)."""
    from webdataset.gopen import gopen

    if url.startswith("s3://"):
        return gopen(f"pipe:aws s3 cp {url} -")
    return gopen(url)


def _samples(stream: IO[bytes], url: str) -> Iterator[dict[str, bytes | str]]:
    from webdataset.tariterators import group_by_keys, tar_file_iterator

    files = ({**member, "__url__": url} for member in tar_file_iterator(stream))
    for sample in group_by_keys(files):
        sample.pop("__url__", None)
        yield sample


def iter_stream(stream: IO[bytes], url: str) -> Iterator[dict[str, bytes | str]]:
    """The samples of an open tar stream; raise TruncatedShard at a broken tail after
    yielding every complete sample before it (no retry: the caller owns the stream)."""
    try:
        yield from _samples(stream, url)
    except (tarfile.ReadError, EOFError, ValueError, OSError) as err:
        raise TruncatedShard(f"{url}: {err}") from None


def _reason(url: str, error: OSError) -> str:
    """A short cause: the reading command's exit status (webdataset's pipes report their
    whole argument list), else the error's first line."""
    status = re.search(r"exit (\d+)", str(error))
    if status is None:
        return first_line(error, 160)
    tool = {"http": "curl", "https": "curl", "gs": "gsutil", "s3": "aws"}.get(
        url.split(":", 1)[0], url[len("pipe:"):].split(" ", 1)[0])
    return f"{tool} exit status {status.group(1)}"


def iter_shard(url: str | Path, retry: Retry = DEFAULT_RETRY,
               skip: int = 0) -> Iterator[dict[str, bytes | str]]:
    """Yield ``{"__key__": key, ext: bytes, ...}`` per sample from sample ``skip`` on; raise
    TruncatedShard at a broken tail after yielding every complete sample before it. Remote
    reads retry (see the module docstring); a local file is read once, and reaches sample
    ``skip`` by reading tar headers only (:func:`sample_offset`)."""
    url = str(url)
    delivered, failures = skip, 0
    while True:
        try:
            stream, first = open_url(url), 0
            if skip and not is_remote(url):
                first = _seek_to_sample(stream, url, skip)
            try:
                for index, sample in enumerate(_samples(stream, url), start=first):
                    if index >= delivered:  # skip what was asked for or already delivered
                        delivered += 1
                        yield sample
            finally:
                stream.close()
            return
        except (tarfile.ReadError, EOFError, ValueError) as err:
            # the source delivered all it has (a failed transfer raises OSError on close)
            raise TruncatedShard(f"{url}: {err}") from None
        except OSError as err:  # the file, the connection or the command failed
            if not is_remote(url):
                raise TruncatedShard(f"{url}: {err}") from None
            error = err
        failures += 1
        if failures >= retry.attempts:
            raise ShardUnreachable(f"{url}: unreachable after {failures} attempts "
                                   f"({_reason(url, error)})") from None
        wait = retry.wait * 2 ** (failures - 1)
        log.warning("data: reading %s failed after %d samples (%s); retry %d of %d in %.1fs",
                    url, delivered, _reason(url, error), failures, retry.attempts - 1, wait)
        time.sleep(wait)


def iter_verified_shard(url: str, sha256: str, retry: Retry = DEFAULT_RETRY,
                        skip: int = 0) -> Iterator[dict[str, bytes | str]]:
    """:func:`iter_shard` of a remote shard that is first downloaded whole into a temporary
    file (memory up to 64 MiB, then disk) and hashed as it arrives; ChecksumMismatch
    before any sample when its SHA-256 differs from ``sha256``."""
    import hashlib
    import tempfile

    failures = 0
    while True:
        digest = hashlib.sha256()
        copy = tempfile.SpooledTemporaryFile(max_size=64 << 20)
        try:
            stream = open_url(url)
            try:
                while chunk := stream.read(1 << 20):
                    digest.update(chunk)
                    copy.write(chunk)
            finally:
                stream.close()
            break
        except OSError as err:
            copy.close()
            failures += 1
            if failures >= retry.attempts:
                raise ShardUnreachable(f"{url}: unreachable after {failures} attempts "
                                       f"({_reason(url, err)})") from None
            time.sleep(retry.wait * 2 ** (failures - 1))
    with copy:
        if digest.hexdigest() != sha256:
            raise ChecksumMismatch(f"{url}: SHA-256 {digest.hexdigest()[:12]}... differs from "
                                   f"the manifest's {sha256[:12]}...")
        copy.seek(0)
        for index, sample in enumerate(iter_stream(copy, url)):
            if index >= skip:
                yield sample


def sample_offset(path: str | Path, index: int) -> int | None:
    """The byte offset of the first member of sample ``index`` of a local tar, found by
    reading headers only (tarfile seeks over member data); None when the tar has fewer
    samples or its headers do not read."""
    try:
        for seen, (_, offset) in enumerate(_sample_starts(path)):
            if seen == index:
                return offset
    except (tarfile.TarError, EOFError, OSError):
        return None
    return None


def sample_keys(url: str | Path, retry: Retry = DEFAULT_RETRY) -> Iterator[str]:
    """Every sample's ``__key__`` in order: a local tar's from its headers alone, a remote
    one's by reading it; a broken tail ends the keys (as it ends the samples)."""
    if not is_remote(str(url)):
        try:
            yield from (key for key, _ in _sample_starts(url))
        except (tarfile.TarError, EOFError, OSError):
            return
        return
    try:
        yield from (str(sample["__key__"]) for sample in iter_shard(url, retry))
    except TruncatedShard:
        return


def _sample_starts(path: str | Path) -> Iterator[tuple[str, int]]:
    """(key, offset of its first member) per sample of a local tar, from headers only.
    Samples are delimited as webdataset's ``tar_file_iterator`` and ``group_by_keys``
    delimit them: regular members, metadata names (``__*__``) left out, a new sample
    wherever the key changes."""
    from webdataset.tariterators import base_plus_ext, meta_prefix, meta_suffix

    key = None
    with tarfile.open(path, "r:") as tar:
        for member in tar:
            name = member.name
            if (not member.isreg() or META.match(name)
                    or ("/" not in name and name.startswith(meta_prefix)
                        and name.endswith(meta_suffix))):
                continue
            prefix, _ = base_plus_ext(name)
            if prefix is None or prefix == key:
                continue
            key = prefix
            yield prefix, member.offset


def _seek_to_sample(stream: IO[bytes], url: str, index: int) -> int:
    """Move ``stream`` (a local file) to sample ``index``; the index it now stands at (0
    when the offset is unknown: the caller then reads up to it)."""
    offset = sample_offset(url, index)
    if offset is None:
        return 0
    stream.seek(offset)
    return index


def write_shard(path: Path, samples: Iterable[Sample]) -> int:
    """Write ``samples`` to ``path`` atomically (temporary file, then rename) with
    webdataset's writer; returns the count."""
    from webdataset import TarWriter

    tmp = path.with_name(path.name + ".tmp")
    count = 0
    with open(tmp, "wb") as handle, TarWriter(handle, user="", group="", mtime=0.0,
                                               encoder=False) as writer:
        for sample in samples:
            record: dict[str, bytes | str] = {"__key__": sample.key, sample.ext: sample.image}
            if sample.label is not None:
                record["cls"] = str(sample.label).encode()
            if sample.caption is not None:
                record["txt"] = sample.caption.encode("utf-8")
            writer.write(record)
            count += 1
    os.replace(tmp, path)
    return count
