"""Reading one shard's valid samples, joined to their caption-store rows.

Every problem becomes a counted skip in the stream's :class:`SampleChecker`: a sample that
fails validation, a key missing from the caption store, a shard whose tar ends early.
"""

from __future__ import annotations

from collections.abc import Iterator

from data_pipeline.formats import SkipSample
from data_pipeline.graph.store import CaptionStore
from data_pipeline.samples import RawSample, SampleChecker, ShardSet
from data_pipeline.tario import TruncatedShard, iter_shard


class ShardReader:
    """Valid samples of any shard of ``shards``; ``caption_store`` (a directory or "")
    adds each sample's embedding row, and a sample without one is skipped."""

    def __init__(self, shards: ShardSet, checker: SampleChecker, caption_store: str) -> None:
        self.shards, self.checker = shards, checker
        self.store = CaptionStore.open(caption_store) if caption_store else None

    def read(self, index: int) -> Iterator[RawSample]:
        path = self.shards.paths[index]
        try:
            for raw in iter_shard(path):
                try:
                    yield self._join(self.checker.parse(raw, path.name))
                except SkipSample as skip:
                    self.checker.skip(skip.reason, path.name)
        except TruncatedShard:
            self.checker.skip("truncated_shard", path.name)

    def _join(self, sample: RawSample) -> RawSample:
        if self.store is not None:
            rows, found = self.store.find([sample.key])
            if not found[0]:
                raise SkipSample("missing_embedding", sample.key)
            sample.row = int(rows[0])
        return sample
