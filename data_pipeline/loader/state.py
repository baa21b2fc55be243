"""Where the training stream stands; saved in and restored from checkpoints.

``epoch`` and ``batches`` (batches delivered in that epoch) say where to continue.
``bad_keys`` lists the undecodable samples met so far in the epoch, so a resumed stream
skips exactly what the first run skipped without decoding anything it replays.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from data_pipeline.samples import MAX_EXAMPLES


@dataclass
class LoaderState:
    epoch: int = 0
    batches: int = 0  # batches delivered in this epoch
    bad_keys: list[str] = field(default_factory=list)  # undecodable samples this epoch
    skipped: dict[str, int] = field(default_factory=dict)  # all epochs, per reason
    skipped_places: dict[str, int] = field(default_factory=dict)  # per "reason shard"
    skipped_examples: list[str] = field(default_factory=list)  # the first named skips

    def record(self, batch: dict[str, Any]) -> None:
        self.batches += 1
        self.bad_keys.extend(batch["skipped_keys"])
        for reason, count in batch["skipped"].items():
            self.skipped[reason] = self.skipped.get(reason, 0) + count
        for place, count in batch.get("skipped_places", {}).items():
            self.skipped_places[place] = self.skipped_places.get(place, 0) + count
        room = MAX_EXAMPLES - len(self.skipped_examples)
        self.skipped_examples.extend(batch.get("skipped_examples", [])[:max(0, room)])

    def summary(self) -> str:
        """One line per reason and shard, then the named examples; "" when nothing was
        skipped."""
        if not self.skipped:
            return ""
        lines = [f"skipped {sum(self.skipped.values())} samples: {dict(self.skipped)}"]
        lines += [f"  {count:>6}  {place}" for place, count in sorted(
            self.skipped_places.items(), key=lambda item: -item[1])]
        lines += [f"  e.g. {example}" for example in self.skipped_examples]
        return "\n".join(lines)

    def next_epoch(self) -> None:
        self.epoch, self.batches, self.bad_keys = self.epoch + 1, 0, []

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> LoaderState:
        return cls(**state)
