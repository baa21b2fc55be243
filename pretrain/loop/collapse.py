"""Collapse detection: a run whose embeddings collapse is told so, then stopped.

Three signs, checked on every metric row (``train.log_every`` steps, averaged over ranks):

- **similarities met**: the mean cosine of positive pairs and of negative pairs came
  within ``min_gap`` of each other *while both are high* (negatives above
  ``high_similarity``): every embedding points the same way. (Near 0 with a small gap the
  embeddings are spread but not yet separated, which is how training starts, not
  collapse.)
- **low effective rank**: the effective rank (Roy & Vetterli 2007: exp of the entropy of
  the normalised singular values) of a rank's batch of L2-normalised embeddings fell
  below ``min_rank``: the embeddings span a line or a plane.
- **backbone collapse**: the spread of the backbone's features across the batch
  (:func:`backbone_measures`) fell below ``backbone_spread_ratio`` times its value in the
  run's first metric row: the images map to ever more alike features, even where the
  projector's batch norm keeps the projections spread (the first two signs watch the
  projections only). Relative, because architectures start apart: a ReLU CNN's pooled
  features are non-negative and start less spread than a transformer's.

A row showing either warns (log, progress bar, MLflow metric ``collapse``); ``patience``
such rows in a row stop the run with :class:`Collapsed`, whose message names what to
change. ``docs/learning.md`` ("Why SupCon collapsed") explains the usual cause.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from core.config import InvalidValue
from core.errors import RunError


@dataclass
class CollapseConfig:
    """``train.collapse.*``."""

    enabled: bool = True  # watch every metric row for collapse
    min_gap: float = 0.01  # positive minus negative cosine below this: the similarities met
    high_similarity: float = 0.8  # ... when negatives are at least this similar
    min_rank: float = 2.0  # effective rank of a batch of embeddings below this: collapsed
    backbone_spread_ratio: float = 0.25  # backbone spread below this x its first row's: collapsed
    patience: int = 3  # rows in a row showing collapse before the run stops; 0: warn only

    def validate(self) -> None:
        if self.min_rank < 1 or self.patience < 0:
            raise InvalidValue("min_rank", "need min_rank >= 1 and patience >= 0")
        if not 0 <= self.backbone_spread_ratio < 1:
            raise InvalidValue("backbone_spread_ratio", "must lie in [0, 1), got "
                               f"{self.backbone_spread_ratio}")


class Collapsed(RunError):
    """The embeddings collapsed for ``patience`` metric rows in a row: the run stops with
    one line naming the symptom and what to change."""


BACKBONE_ROWS = 512  # rows of the batch the backbone measures use (an [n, n] product)


def backbone_measures(features: Tensor, ids: Tensor) -> dict[str, Tensor]:
    """How alike the backbone's features of a batch are, each [] (no gradient):

    - ``backbone_cos``: the mean cosine between the features of different images (rows
      whose ``ids`` differ; the views of one image are left out);
    - ``backbone_spread``: the root mean square distance of the rows from the batch's mean
      feature over the root mean square norm of the rows: 0 when every row is the same
      vector, 1 for rows centred on zero.

    A backbone can collapse behind a projector whose batch norm rescales what is left
    (the projections stay spread); these see it. ``features`` [n, F] (the first
    :data:`BACKBONE_ROWS` rows are used), ``ids`` [n]."""
    with torch.no_grad(), torch.autocast(features.device.type, enabled=False):
        x = features[:BACKBONE_ROWS].float().flatten(1)
        ids = ids[:BACKBONE_ROWS]
        unit = torch.nn.functional.normalize(x, dim=1)
        different = (ids[:, None] != ids[None, :]).float()
        cos = ((unit @ unit.T) * different).sum() / different.sum().clamp(min=1)
        spread = ((x - x.mean(0)).pow(2).sum(1).mean().sqrt()
                  / x.pow(2).sum(1).mean().sqrt().clamp(min=1e-12))
    return {"backbone_cos": cos, "backbone_spread": spread}


def effective_rank(embeddings: Tensor) -> Tensor:
    """Effective rank [] of the rows of ``embeddings`` [n, D] after L2 normalisation:
    exp(-sum_k p_k log p_k) with p = singular values / their sum; 1 for identical rows,
    up to min(n, D) for rows spread evenly over the space."""
    with torch.no_grad(), torch.autocast(embeddings.device.type, enabled=False):
        rows = torch.nn.functional.normalize(embeddings.float(), dim=1)
        singular = torch.linalg.svdvals(rows)
        p = singular / singular.sum().clamp(min=1e-12)
        return torch.exp(-(p * torch.log(p.clamp(min=1e-12))).sum())


ADVICE = ("The usual cause: the objective can lower its loss by making every similarity "
          "equal faster than it learns what makes positives alike (labels the untrained "
          "encoder cannot yet see, or augmentation that hides them). Keep "
          "model.projector_bn_out=true (the projector's batch-normalised output cannot "
          "collapse to one point), keep the label visible in both views (data.flip, "
          "data.crop_min_scale), or lower optim.lr.")


class CollapseWatch:
    """Reads metric rows; says what it sees, and stops the run past the patience."""

    def __init__(self, cfg: CollapseConfig) -> None:
        self.cfg = cfg
        self.in_row = 0
        self.last: tuple[int, str | None] = (0, None)
        self.first_spread: float | None = None  # the run's first backbone spread

    def state_dict(self) -> dict[str, float]:
        """What a checkpoint keeps: the run's first backbone spread."""
        return {} if self.first_spread is None else {"first_spread": self.first_spread}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.first_spread = state.get("first_spread", self.first_spread)

    def symptom(self, row: dict[str, float]) -> str | None:
        """What in ``row`` shows collapse, or None."""
        cfg = self.cfg
        pos, neg = row.get("pos_sim"), row.get("neg_sim")
        if pos is not None and neg is not None and pos - neg < cfg.min_gap and \
                neg >= cfg.high_similarity:
            return (f"positive and negative similarity met (positive {pos:.3f}, "
                    f"negative {neg:.3f})")
        rank = row.get("effective_rank")
        if rank is not None and rank < cfg.min_rank:
            return f"the embeddings' effective rank fell to {rank:.2f}"
        spread = row.get("backbone_spread")
        if spread is not None and self.first_spread is None:
            self.first_spread = spread
        if spread is not None and spread < cfg.backbone_spread_ratio * self.first_spread:
            return (f"the backbone's features of different images became alike (spread "
                    f"{spread:.3f}, {spread / self.first_spread:.0%} of its first "
                    f"{self.first_spread:.3f}; mean cosine "
                    f"{row.get('backbone_cos', float('nan')):.3f}) behind a projector that "
                    "still looks spread")
        return None

    def check(self, step: int, row: dict[str, float]) -> str | None:
        """The warning for this row, or None when it looks healthy (a row that measured
        nothing, every step a placeholder, leaves the count of rows in a row as it is)."""
        if "effective_rank" not in row and "pos_sim" not in row:
            return None
        symptom = self.symptom(row) if self.cfg.enabled else None
        self.in_row = self.in_row + 1 if symptom else 0
        self.last = (step, symptom)
        return None if symptom is None else f"step {step}: collapse warning: {symptom}"

    def stop_if_spent(self) -> None:
        """Raise :class:`Collapsed` once ``patience`` rows in a row showed collapse."""
        patience = self.cfg.patience
        if patience and self.in_row >= patience:
            step, symptom = self.last
            raise Collapsed(f"training collapsed at step {step}: {symptom} for {self.in_row} "
                            f"metric rows in a row (train.collapse.patience={patience}). "
                            f"{ADVICE}")
