"""Hoelder-FlatNCE (FlatNCE paper, Def. 3.6 and Prop. 3.7); ``docs/objectives.md``.

With g+ = gamma s_ip/tau and g_j = gamma s_ij/tau over the negatives j in Neg(i):
    v_i = logsumexp_j (g_j - g+),   loss_i = exp(v_i - detach(v_i)) - 1.
The project's definition: FlatNCE applied to gamma * logits. The paper's form,
m_gamma / detach(m_gamma) with the Hoelder mean m_gamma of exp(g_j - g+), has exactly
1/gamma times this gradient (appendix eq. 30-34); the tests check that identity.
gamma > 1 sharpens the weighting of hard negatives: gamma * s / tau = s / (tau / gamma),
so this is FlatNCE at temperature tau / gamma, and its metrics (InfoNCE value, ESS) are
those of that effective temperature, the one its gradient sees; ``temperature`` reports
the configured tau and ``effective_temperature`` tau / gamma.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from core.config import InvalidValue
from pretrain.contrast.vocabulary import BatchRows, ContrastiveBatch, ObjectiveOutput
from pretrain.objectives.flatnce import flatnce, plain_flatnce


def plain_holder_flatnce(rows: BatchRows, tau: float | Tensor, gamma: float) -> Tensor:
    """Hoelder-FlatNCE as this project defines it: FlatNCE on gamma * s / tau."""
    return plain_flatnce(rows, tau / gamma)


@dataclass
class HolderFlatNCEConfig:
    """``objective.holder_flatnce.*``."""

    gamma: float = 2.0  # scale of the logits: FlatNCE at temperature tau / gamma

    def validate(self) -> None:
        if not self.gamma > 0:
            raise InvalidValue("gamma", f"must be > 0, got {self.gamma}")


def holder_flatnce(batch: ContrastiveBatch, temperature: float | Tensor, *,
                   gamma: float) -> ObjectiveOutput:
    """FlatNCE on gamma * s / tau, i.e. at the effective temperature tau / gamma."""
    out = flatnce(batch, temperature / gamma)
    effective = out.metrics["temperature"]
    out.metrics.update(effective_temperature=effective, temperature=effective * gamma)
    return out
