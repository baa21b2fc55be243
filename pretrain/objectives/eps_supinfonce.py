"""epsilon-SupInfoNCE (Barbano et al., as restated by SINCERE, eq. 6); docs/objectives.md.

per anchor i: -1/|P(i)| sum_{p in P(i)} log( e^{s_ip/tau} / (e^{s_ip/tau - eps}
                                                      + sum_{n in Neg(i)} e^{s_in/tau}) )
SINCERE with the lone positive term of each denominator replaced by exp(s_ip/tau - eps),
a margin eps >= 0 between the positive and the negatives; eps = 0 is exactly SINCERE.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from core.config import InvalidValue
from pretrain.contrast.vocabulary import BatchRows, ContrastiveBatch, ObjectiveOutput
from pretrain.objectives.sincere import plain_sincere, sincere_family


def plain_eps_supinfonce(rows: BatchRows, tau: float | Tensor, eps: float) -> Tensor:
    """epsilon-SupInfoNCE as written: SINCERE's pair terms with the margin ``eps``."""
    return plain_sincere(rows, tau, eps)


@dataclass
class EpsSupInfoNCEConfig:
    """``objective.eps_supinfonce.*``."""

    eps: float = 0.1  # margin on the positive's denominator term (0 = sincere)

    def validate(self) -> None:
        if self.eps < 0:
            raise InvalidValue("eps", f"must be >= 0, got {self.eps}")


def eps_supinfonce(batch: ContrastiveBatch, temperature: float | Tensor, *,
                   eps: float) -> ObjectiveOutput:
    """SINCERE with margin ``eps`` on the positive's denominator term."""
    return sincere_family(batch, temperature, eps=eps)
