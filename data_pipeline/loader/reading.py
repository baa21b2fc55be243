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
from data_pipeline.samples import RawSample, SampleChecker
from data_pipeline.shards import ShardSet
from data_pipeline.tario import DEFAULT_RETRY, Retry, TruncatedShard, iter_shard


class ShardReader:
    """Valid samples of any shard of ``shards``; ``caption_store`` (a directory or "")
    adds each sample's embedding row, and a sample without one is skipped."""

    def __init__(self, shards: ShardSet, checker: SampleChecker, caption_store: str,
                 retry: Retry = DEFAULT_RETRY) -> None:
        self.shards, self.checker, self.retry = shards, checker, retry
        self.store = CaptionStore.open(caption_store) if caption_store else None

    def read(self, index: int) -> Iterator[RawSample]:
        url, name = self.shards.urls[index], self.shards.names[index]
        expected = self.shards.counts[index]
        read, broken = 0, ""
        try:
            for raw in iter_shard(url, self.retry):
                read += 1
                try:
                    yield self._join(self.checker.parse(raw, name))
                except SkipSample as skip:
                    self.checker.skip(skip.reason, name, detail=skip.detail)
        except TruncatedShard as err:
            broken = str(err)
        if read < expected:
            self.checker.seen += expected - read
            self.checker.skip("truncated_shard", name, count=expected - read,
                              detail=f"{read} of the manifest's {expected} samples read")
        elif broken:
            self.checker.skip("truncated_shard", name, detail=broken)

    def _join(self, sample: RawSample) -> RawSample:
        if self.store is not None:
            rows, found = self.store.find([sample.key])
            if not found[0]:
                raise SkipSample("missing_embedding", sample.key)
            sample.row = int(rows[0])
        return sample
