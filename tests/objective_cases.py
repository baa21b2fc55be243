"""The cases every objective test matrix takes from the table of objectives.

One case per entry of ``OBJECTIVES`` and per setting in its ``examples``; an objective with
soft targets runs twice, its targets from captions and from a class graph. What a case
hands the objective is what its entry declares: labels, captions or a class graph, a
text embedding, its loss parameters. A new entry is in every matrix with no test edit
(``tests/pretrain/objectives/test_toy_objective.py`` shows it).
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from pretrain.contrast.parameters import ParameterShape, initial_values
from pretrain.objectives import OBJECTIVES, BatchRows, ObjectiveSpec

# modules that add entries to the table when imported, as "a.b,c.d" (the toy objective's
# test sets it; spawned ranks inherit it and import this module to unpickle a case)
EXTRA_ENTRIES = "TEST_OBJECTIVE_ENTRIES"
for module in filter(None, os.environ.get(EXTRA_ENTRIES, "").split(",")):
    importlib.import_module(module)


@dataclass(frozen=True)
class ObjectiveCase:
    """Objective ``name`` under ``example`` (its own keys over their defaults); with
    ``class_graph``, soft targets from a class graph instead of captions."""

    name: str
    example: dict[str, Any]
    class_graph: bool = False

    @property
    def spec(self) -> ObjectiveSpec:
        return OBJECTIVES[self.name]

    @property
    def id(self) -> str:
        words = [self.name, *("class-graph",) * self.class_graph]
        words += [f"{key}={value}" for key, value in self.example.items()]
        return "-".join(words)

    @property
    def keys(self) -> dict[str, Any]:
        """Every key of the objective's own section: its defaults, then the example."""
        return self.spec.defaults() | self.example

    @property
    def needs_labels(self) -> bool:
        return self.spec.labels or self.class_graph

    @property
    def needs_captions(self) -> bool:
        return self.spec.soft_targets and not self.class_graph

    def rows(self, z: Tensor, ids: Tensor, labels: Tensor, captions: Tensor,
             text: Tensor) -> BatchRows:
        """The rows this case hands the objective: what its entry declares, nothing else."""
        return BatchRows(z, ids, labels if self.needs_labels else None,
                         captions if self.needs_captions else None,
                         text if self.spec.text_tower else None)

    def keywords(self, num_classes: int, dim: int, dtype: torch.dtype) -> dict[str, Any]:
        """The keywords beside the rows, for ``batch_loss`` and the plain form alike: the
        objective's keys, the loss parameters they use (seeded), the class graph."""
        with torch.random.fork_rng():
            torch.manual_seed(4)
            parameters = initial_values(self.spec.parameters, self.keys,
                                        ParameterShape(num_classes, dim))
            graph = torch.rand(num_classes, num_classes, dtype=dtype)
        keywords = self.keys | {k: v.to(dtype) for k, v in parameters.items()}
        return keywords | ({"class_graph": graph} if self.class_graph else {})

    def parameter_leaves(self, keywords: dict[str, Any]) -> list[Tensor]:
        """The loss parameters among ``keywords``, made leaves that require a gradient."""
        return [keywords[p.name].requires_grad_() for p in self.spec.parameters
                if p.name in keywords]


def objective_cases() -> list[ObjectiveCase]:
    """Every entry of the table under each of its examples (read when called, so an entry
    added before the tests are collected is among them)."""
    return [ObjectiveCase(name, dict(example), graph)
            for name, spec in OBJECTIVES.items() for example in spec.examples
            for graph in ((False, True) if spec.soft_targets else (False,))]


def case_ids(cases: list[ObjectiveCase]) -> list[str]:
    return [case.id for case in cases]
