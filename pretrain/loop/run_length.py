"""How far a run goes, measured in samples of the data set (``docs/training.md``, "Run
length and global batch")."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RunLength:
    """How far a run goes, in samples of the data set: ``epochs`` epochs of
    ``samples_per_epoch`` (whole global batches), or ``max_steps`` steps; every step takes
    ``samples_per_step``, the global batch, on any number of ranks."""

    samples_per_step: int
    samples_per_epoch: int
    epochs: int = 1
    max_steps: int = 0

    @property
    def total_samples(self) -> int:
        if self.max_steps:
            return self.max_steps * self.samples_per_step
        return self.epochs * self.samples_per_epoch

    def epoch(self, samples: int) -> float:
        """Epochs delivered after ``samples`` samples."""
        return samples / self.samples_per_epoch


__all__ = ["RunLength"]
