"""Where the training stream stands; saved in and restored from checkpoints.

``epoch`` and ``batches`` (batches delivered in that epoch) say where to continue.
``bad_keys`` lists the undecodable samples met so far in the epoch, so a resumed stream
skips exactly what the first run skipped without decoding anything it replays.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class LoaderState:
    epoch: int = 0
    batches: int = 0  # batches delivered in this epoch
    bad_keys: list[str] = field(default_factory=list)  # undecodable samples this epoch
    skipped: dict[str, int] = field(default_factory=dict)  # all epochs, per reason

    def record(self, batch: dict[str, Any]) -> None:
        self.batches += 1
        self.bad_keys.extend(batch["skipped_keys"])
        for reason, count in batch["skipped"].items():
            self.skipped[reason] = self.skipped.get(reason, 0) + count

    def next_epoch(self) -> None:
        self.epoch, self.batches, self.bad_keys = self.epoch + 1, 0, []

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> LoaderState:
        return cls(**state)
