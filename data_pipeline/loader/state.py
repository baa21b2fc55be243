"""Where the training stream stands; saved in and restored from checkpoints.

``epoch`` and ``batches`` (global batches delivered in that epoch under ``layout``, the
``[positions a step, positions a chunk]`` that delivered them) say where to continue, on
any world. ``layouts`` lists the earlier layouts of the epoch as ``[per step, per chunk,
batches]``: a run resumed under another layout continues with the work the earlier ones
left (``data_pipeline/loader/plan.py``). States saved before chunk slots name their
layouts ``[world, workers, per step]`` (``[..., batches]`` for earlier ones).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from data_pipeline.samples import MAX_EXAMPLES

GLOBAL_LAYOUTS = "global_layouts"  # a state's layouts count positions per step


@dataclass
class LoaderState:
    epoch: int = 0
    batches: int = 0  # global batches delivered in this epoch under `layout`
    layout: list[int] = field(default_factory=list)  # [per step, per chunk]
    layouts: list[list[int]] = field(default_factory=list)  # earlier ones of the epoch
    skipped: dict[str, int] = field(default_factory=dict)  # all epochs, per reason
    skipped_places: dict[str, int] = field(default_factory=dict)  # per "reason shard"
    skipped_examples: list[str] = field(default_factory=list)  # the first named skips

    def record(self, batch: dict[str, Any]) -> None:
        self.batches += 1
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

    def enter(self, layout: list[int]) -> None:
        """Continue under ``layout``: after batches delivered under another one, that one
        joins the epoch's earlier layouts and the count starts again."""
        if self.layout and self.layout != layout and self.batches:
            self.layouts.append([*self.layout, self.batches])
            self.batches = 0
        self.layout = list(layout)

    def next_epoch(self) -> None:
        self.epoch, self.batches, self.layouts = self.epoch + 1, 0, []

    def state_dict(self) -> dict[str, Any]:
        return {**asdict(self), GLOBAL_LAYOUTS: True}

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> LoaderState:
        """The state saved by :meth:`state_dict`; keys of older versions are dropped, and
        their layouts (positions per rank's batch) read as positions per step."""
        known = {f.name for f in fields(cls)}
        restored = cls(**{k: v for k, v in state.items() if k in known})
        if not state.get(GLOBAL_LAYOUTS):
            restored.layouts = [[w, k, w * b, n] for w, k, b, n in restored.layouts]
            if restored.layout:
                w, k, b = restored.layout
                restored.layout = [w, k, w * b]
        return restored
