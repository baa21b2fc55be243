"""Reading one shard's valid samples, joined to their caption-store rows.

Every problem becomes a counted skip in the stream's :class:`SampleChecker`: a sample that
fails validation, a key missing from the caption store, a shard whose tar ends early. A
shard that yields fewer samples than its manifest lists (a tar cut inside a header reads
as a clean end) counts each missing sample as ``truncated_shard``, naming the shard.
"""

from __future__ import annotations

from collections.abc import Iterator

from data_pipeline.formats import SkipSample
from data_pipeline.graph.store import CaptionStore
from data_pipeline.samples import RawSample, SampleChecker, Skip
from data_pipeline.shards import ShardSet
from data_pipeline.tario import (
    DEFAULT_RETRY,
    ChecksumMismatch,
    Retry,
    TruncatedShard,
    is_remote,
    iter_shard,
    iter_verified_shard,
)


class ShardReader:
    """Valid samples of any shard of ``shards``; ``caption_store`` (a directory or "")
    adds each sample's embedding row, and a sample without one is skipped. With
    ``verify``, a remote shard whose manifest records a checksum is downloaded and checked
    before its samples are read; one that differs is skipped whole (``checksum_mismatch``)."""

    def __init__(self, shards: ShardSet, checker: SampleChecker, caption_store: str,
                 retry: Retry = DEFAULT_RETRY, verify: bool = False) -> None:
        self.shards, self.checker, self.retry, self.verify = shards, checker, retry, verify
        self.store = CaptionStore.open(caption_store) if caption_store else None

    def read(self, index: int) -> Iterator[RawSample]:
        """The valid samples of shard ``index``, in file order, to the end of its file."""
        for _, sample in self.read_range(index, 0, None):
            if isinstance(sample, Skip):
                self.checker.log.add(sample)
            else:
                yield sample

    def read_range(self, index: int, start: int, stop: int | None,
                   ) -> Iterator[tuple[int, RawSample | Skip]]:
        """``(i, sample)`` for each sample i in [start, stop) of shard ``index`` (None: to
        the end of the file): the sample, or the :class:`Skip` it was (counted, not yet
        logged). Samples the shard lacks (truncated, or fewer than its manifest lists)
        are each a ``truncated_shard`` skip."""
        url, name = self.shards.urls[index], self.shards.names[index]
        expected = self.shards.counts[index]
        position, broken, reason = start, "", "truncated_shard"
        checksum = self.shards.checksums[index] if self.shards.checksums else ""
        samples = (iter_verified_shard(url, checksum, self.retry, skip=start)
                   if self.verify and checksum and is_remote(url)
                   else iter_shard(url, self.retry, skip=start))
        try:
            for raw in samples:
                if stop is not None and position >= stop:
                    break
                try:
                    yield position, self._join(self.checker.parse(raw, name))
                except SkipSample as skip:
                    yield position, self.checker.tally(skip.reason, name, skip.detail)
                position += 1
        except TruncatedShard as err:
            broken = str(err)
        except ChecksumMismatch as err:
            broken, reason = str(err), "checksum_mismatch"
        whole, stop = stop is None, expected if stop is None else stop
        if position < stop:
            self.checker.seen += stop - position
            detail = (broken if reason == "checksum_mismatch" else
                      f"{position} of the manifest's {expected} samples read"
                      if position > start else
                      f"no sample from {start} on (the manifest lists {expected})")
            self.checker.tally(reason, name, detail, count=stop - position)
            for missing in range(position, stop):
                yield missing, Skip(reason, name, detail)
        elif broken and whole:  # a broken tail after every listed sample
            self.checker.skip("truncated_shard", name, detail=broken)

    def _join(self, sample: RawSample) -> RawSample:
        if self.store is not None:
            rows, found = self.store.find([sample.key])
            if not found[0]:
                raise SkipSample("missing_embedding", sample.key)
            sample.row = int(rows[0])
        return sample
