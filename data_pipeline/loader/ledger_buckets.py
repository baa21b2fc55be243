"""One bucket of the ledger reader's spill (``data_pipeline/loader/ledger.py``), counted.

A bucket file holds lines ``<epoch>\\t<key>\\t<where>\\n``: first every shard key of the
bucket (epoch :data:`SHARD_KEY`, no ``where``), then every read of the bucket's keys with
the ledger file and line that made it. Keys and places are escaped (backslash, tab,
newline), so any key a tar or a ledger holds is one field. A bucket is counted in numpy
arrays of its keys' bytes, sorted: a few tens of bytes a key, not a Python string and
dictionary entry each.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

SHARD_KEY = "S"  # the epoch field of a spilled shard key
LINES_AT_ONCE = 1 << 14  # bucket lines parsed into arrays at a time
UNKNOWN_EXAMPLES = 5  # unknown reads named per epoch
END = b"\t"  # ends every key in an array: numpy's bytes arrays trim trailing NULs
ESCAPES = {"\\": "\\\\", "\t": "\\t", "\n": "\\n"}
UNESCAPES = {"\\": "\\", "t": "\t", "n": "\n"}


@dataclass
class EpochCount:
    """One epoch's samples, by key against the keys the shards hold: ``once`` and
    ``more_than_once`` count shard keys by how often the epoch trained on them, ``unread``
    the shard keys it never trained on (the loader's skips among them), ``skipped`` the
    loader's skip count, ``unknown`` the reads of keys the shards do not hold (a fault: named
    in ``unknown_examples`` with the ledger file and line). With ``keys``, the unread and
    repeated keys themselves."""

    total: int
    once: int = 0
    more_than_once: int = 0
    unread: int = 0
    skipped: int = 0
    unknown: int = 0
    unknown_examples: list[str] = field(default_factory=list)
    unread_keys: list[str] | None = None
    more_keys: list[str] | None = None


def escaped(text: str) -> str:
    """``text`` as one field of a bucket line."""
    return re.sub(r"[\\\t\n]", lambda m: ESCAPES[m.group()], text)


def unescaped(text: str) -> str:
    return re.sub(r"\\(.)", lambda m: UNESCAPES[m.group(1)], text)


def bucket_line(epoch: str, key: str, where: str) -> str:
    return f"{epoch}\t{escaped(key)}\t{escaped(where)}\n"


def tally_bucket(path: Path, counts: dict[int, EpochCount], keep_keys: bool) -> None:
    """Add one bucket's reads to ``counts`` (every epoch's): each read key is the shards'
    (once or more than once) or unknown; the bucket's shard keys an epoch never read are
    its unread ones. The reads are sorted by epoch once, then each epoch's by key."""
    shard, read_keys, read_epochs = read_bucket(path)
    order = np.argsort(read_epochs, kind="stable")
    read_keys, read_epochs = read_keys[order], read_epochs[order]
    unknown_by_epoch: dict[int, np.ndarray] = {}
    for epoch, count in counts.items():
        first, end = np.searchsorted(read_epochs, [epoch, epoch + 1])
        keys, reads = np.unique(read_keys[first:end], return_counts=True)
        known = sorted_member(keys, shard)
        count.total += len(shard)
        count.once += int(np.count_nonzero(known & (reads == 1)))
        count.more_than_once += int(np.count_nonzero(known & (reads > 1)))
        count.unread += len(shard) - int(np.count_nonzero(known))
        count.unknown += int(reads[~known].sum())
        if not known.all():
            unknown_by_epoch[epoch] = keys[~known]
        if keep_keys:
            unread = shard[~sorted_member(shard, keys[known])]
            count.unread_keys = sorted([*(count.unread_keys or []), *decoded(unread)])
            count.more_keys = sorted([*(count.more_keys or []),
                                      *decoded(keys[known & (reads > 1)])])
    if unknown_by_epoch:
        name_unknown_reads(path, counts, unknown_by_epoch)


def bucket_chunks(path: Path) -> itertools.Generator[list[list[str]], None, None]:
    """The bucket's lines split into their three fields, :data:`LINES_AT_ONCE` at a time."""
    with path.open(encoding="utf-8", newline="\n") as lines:
        while chunk := list(itertools.islice(lines, LINES_AT_ONCE)):
            yield [text[:-1].split("\t") for text in chunk]


def read_bucket(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A bucket's shard keys (sorted, distinct) and its reads' keys and epochs."""
    shard: list[np.ndarray] = [encoded([])]
    keys: list[np.ndarray] = [encoded([])]
    epochs: list[np.ndarray] = [np.zeros(0, dtype=np.int64)]
    for fields in bucket_chunks(path):
        shard.append(encoded([key for epoch, key, _ in fields if epoch == SHARD_KEY]))
        _, chunk_epochs, chunk_keys = chunk_reads(fields)
        keys.append(chunk_keys)
        epochs.append(chunk_epochs)
    return np.unique(np.concatenate(shard)), np.concatenate(keys), np.concatenate(epochs)


def chunk_reads(fields: list[list[str]]) -> tuple[list[list[str]], np.ndarray, np.ndarray]:
    """A chunk's reads (its lines but the shard keys), their epochs and their keys."""
    reads = [line for line in fields if line[0] != SHARD_KEY]
    return (reads, np.array([int(epoch) for epoch, _, _ in reads], dtype=np.int64),
            encoded([key for _, key, _ in reads]))


def encoded(keys: list[str]) -> np.ndarray:
    """Escaped ``keys`` as one array of their UTF-8 bytes, each ended by :data:`END`."""
    return np.array([key.encode() + END for key in keys], dtype=np.bytes_)


def decoded(keys: np.ndarray) -> list[str]:
    return [unescaped(key[:-1].decode()) for key in keys.tolist()]


def sorted_member(values: np.ndarray, sorted_set: np.ndarray) -> np.ndarray:
    """Which of ``values`` are in ``sorted_set`` (sorted, distinct), by binary search."""
    if len(sorted_set) == 0:
        return np.zeros(len(values), dtype=bool)
    at = np.minimum(np.searchsorted(sorted_set, values), len(sorted_set) - 1)
    return sorted_set[at] == values


def name_unknown_reads(path: Path, counts: dict[int, EpochCount],
                       unknown_by_epoch: dict[int, np.ndarray]) -> None:
    """Name the first unknown keys of each epoch (in the ledger's order, up to
    :data:`UNKNOWN_EXAMPLES` an epoch over every bucket) with the ledger file and line that
    read them: a second pass over the bucket, taken only when it has unknown reads."""
    named: set[tuple[int, str]] = set()  # a key is in one bucket only: this bucket's
    for fields in bucket_chunks(path):
        reads, epochs, keys = chunk_reads(fields)
        for epoch, unknown in unknown_by_epoch.items():
            examples = counts[epoch].unknown_examples
            for i in np.flatnonzero((epochs == epoch) & sorted_member(keys, unknown)):
                _, key, where = reads[i]
                if len(examples) == UNKNOWN_EXAMPLES:
                    break
                if (epoch, key) not in named:
                    named.add((epoch, key))
                    examples.append(f"{unescaped(key)!r} ({unescaped(where)})")
        if all(len(counts[e].unknown_examples) == UNKNOWN_EXAMPLES for e in unknown_by_epoch):
            return
