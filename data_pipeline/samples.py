"""Validation of raw shard samples and the per-reason accounting of what is skipped."""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass, field
from typing import NamedTuple

from core.errors import RunError
from data_pipeline.formats import SkipSample, image_of

MIN_SEEN_FOR_LIMIT = 20  # the skip fraction is judged once this many samples were seen
SKIP_REASONS = ("missing_image", "corrupt_image", "bad_label", "bad_caption",  # what a loader
                "missing_embedding", "truncated_shard", "unsafe_name",  # skip counts as
                "checksum_mismatch")
MAX_EXAMPLES = 20  # skipped samples named per batch (and kept per run: LoaderState)


class SkipLimitExceeded(RunError):
    """More than ``data.max_skip_fraction`` of the samples were bad."""


def stable_int(*parts: object, bits: int = 63) -> int:
    """A stable non-negative integer hash of ``parts`` (seeds, instance ids)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << bits) - 1)


@dataclass
class RawSample:
    key: str
    shard: str
    image: bytes
    label: int | None
    caption: str | None
    row: int = -1  # the caption store's embedding row, when a store is joined


class Skip(NamedTuple):
    """One cause of skipped samples: ``count`` samples of ``shard`` for ``reason``."""

    reason: str
    shard: str
    detail: str = ""
    count: int = 1


@dataclass
class SkipLog:
    """Skips met while one batch was assembled: counts per reason, per "reason shard", a
    few named samples ("reason shard detail"), and every cause with its count
    (``(reason, shard, detail)``, for the epoch ledger)."""

    counts: Counter = field(default_factory=Counter)
    places: Counter = field(default_factory=Counter)
    examples: list[str] = field(default_factory=list)
    causes: Counter = field(default_factory=Counter)

    def add(self, skip: Skip) -> None:
        self.counts[skip.reason] += skip.count
        self.places[f"{skip.reason} {skip.shard}"] += skip.count
        self.causes[skip.reason, skip.shard, skip.detail] += skip.count
        example = f"{skip.reason} {skip.shard} {skip.detail}".strip()
        if len(self.examples) < MAX_EXAMPLES and example not in self.examples:
            self.examples.append(example)

    def merge(self, other: SkipLog) -> None:
        """Add ``other``'s skips (another worker's, of the same batch)."""
        self.counts.update(other.counts)
        self.places.update(other.places)
        self.causes.update(other.causes)
        room = MAX_EXAMPLES - len(self.examples)
        self.examples += [e for e in other.examples if e not in self.examples][:max(0, room)]

    def take(self) -> SkipLog:
        """What was logged so far, leaving this log empty for the next batch."""
        taken = SkipLog(self.counts, self.places, self.examples, self.causes)
        self.counts, self.places, self.examples, self.causes = (Counter(), Counter(), [],
                                                                Counter())
        return taken

    def as_batch(self) -> dict:
        """The batch entries that carry these skips to the training loop."""
        return {"skipped": dict(self.counts),
                "skipped_places": dict(self.places), "skipped_examples": list(self.examples),
                "skipped_samples": list(self.causes.items())}


class SampleChecker:
    """Turns a raw ``{"__key__", "jpg", "cls", "txt"}`` dict into a :class:`RawSample`,
    raising SkipSample for a missing image, a bad caption or a label outside the class list.
    Every skip is counted in ``log`` (taken per batch) and in the seen/skipped totals that
    enforce ``max_skip_fraction``."""

    def __init__(self, num_classes: int, max_skip_fraction: float) -> None:
        self.num_classes = num_classes
        self.max_skip_fraction = max_skip_fraction
        self.seen = 0
        self.skipped = 0
        self.log = SkipLog()

    def parse(self, raw: dict, shard: str) -> RawSample:
        self.seen += 1
        key = str(raw["__key__"])
        if key.startswith("/") or ".." in key.split("/"):  # nothing is extracted to disk,
            raise SkipSample("unsafe_name", key)            # and no key may look like a path
        image = image_of(raw)
        if not image:
            raise SkipSample("missing_image", key)
        label = None
        if "cls" in raw:
            try:
                label = int(raw["cls"])
            except ValueError:
                raise SkipSample("bad_label", f"{key}: {raw['cls']!r}") from None
        if self.num_classes and (label is None or not 0 <= label < self.num_classes):
            raise SkipSample("bad_label", f"{key}: {label} outside {self.num_classes} classes")
        caption = None
        if "txt" in raw:
            try:
                caption = raw["txt"].decode("utf-8").strip()
            except UnicodeDecodeError:
                raise SkipSample("bad_caption", f"{key}: not UTF-8") from None
            if not caption:
                raise SkipSample("bad_caption", f"{key}: empty")
        return RawSample(key, shard, image, label, caption)

    def skip(self, reason: str, shard: str, detail: str = "", count: int = 1) -> None:
        """Count and log ``count`` skips of one cause (``detail`` names the sample)."""
        self.log.add(self.tally(reason, shard, detail, count))

    def tally(self, reason: str, shard: str, detail: str = "", count: int = 1) -> Skip:
        """Count ``count`` skips of one cause without logging them (the caller logs the
        :class:`Skip` with the batch it belongs to); abort when the bad fraction exceeds
        the limit."""
        self.skipped += count
        if (self.seen >= MIN_SEEN_FOR_LIMIT
                and self.skipped > self.max_skip_fraction * self.seen):
            raise SkipLimitExceeded(
                f"{self.skipped} of {self.seen} samples skipped (> data.max_skip_fraction="
                f"{self.max_skip_fraction}); last in shard {shard} ({reason})")
        return Skip(reason, shard, detail, count)
