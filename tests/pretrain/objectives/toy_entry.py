"""The toy objective's table entry (``test_toy_objective.py``), added to the table on
import (a new objective's entry is a line in ``pretrain/objectives/table.py``). With
``TOY_BROKEN=1`` its production path is off by one per cent, for the check that the
matrices see it."""

from __future__ import annotations

import os

from pretrain.contrast.common import ObjectiveOutput
from pretrain.objectives import OBJECTIVES, ObjectiveSpec
from tests.pretrain.objectives.toy_decoupled import decoupled, plain_decoupled


def broken(*args: object, **kwargs: object) -> ObjectiveOutput:
    out = decoupled(*args, **kwargs)
    return out._replace(loss=out.loss * 1.01)


OBJECTIVES["decoupled"] = ObjectiveSpec(broken if os.environ.get("TOY_BROKEN") else decoupled,
                                        plain_decoupled)
