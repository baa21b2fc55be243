"""epsilon-SupInfoNCE (Barbano et al., as restated by SINCERE, eq. 6); docs/objectives.md.

SINCERE with the lone positive term of each denominator replaced by exp(s_ip/tau - eps),
a margin eps >= 0 between the positive and the negatives; eps = 0 is exactly SINCERE.
"""

from __future__ import annotations

from pretrain.losses.batch import ContrastiveBatch
from pretrain.losses.common import ObjectiveOutput, Temperature
from pretrain.losses.sincere import sincere_family


def eps_supinfonce(batch: ContrastiveBatch, temperature: Temperature, *,
                   eps: float = 0.1) -> ObjectiveOutput:
    """SINCERE with margin ``eps`` on the positive's denominator term."""
    return sincere_family(batch, temperature, eps=eps)
