"""Each objective's file opens as ``pretrain/objectives/__init__.py`` says: a title citing
its paper and where in it, then its plain mathematical form."""

from __future__ import annotations

import re
import sys

import pytest

from pretrain.objectives import OBJECTIVES

PAPER = re.compile(r"et al\.|&|paper|\"")  # authors, or the paper by name
PLACE = re.compile(r"eq\. \d|Def\. \d|Table \d|Algorithm|\d{4}")  # where in it, or its year
# a per-anchor loss, or a short left-hand side = a right-hand side with an operation in it
FORM = re.compile(r"^(per anchor i:|[^=]{1,30}=[^=]*(log|sum|exp|softmax|mean|sigmoid|/))")


def opening_problems(doc: str) -> list[str]:
    """What a module docstring lacks of an objective's opening: a title citing its paper,
    then, as the first line after it, its plain form."""
    title, _, rest = doc.partition("\n\n")
    first = rest.splitlines()[0] if rest.strip() else ""
    return ([] if PAPER.search(title) and PLACE.search(title)
            else ["no paper cited in its title"]) + (
        [] if FORM.search(first) else ["no plain form after its title"])


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_each_objective_file_opens_with_its_paper_and_plain_form(name):
    module = sys.modules[OBJECTIVES[name].plain.__module__]
    assert opening_problems(module.__doc__ or "") == [], module.__file__


@pytest.mark.parametrize("opening, problems", [
    ("Decoupled (Yeh et al. 2022).\n\nInfoNCE without the positive in its denominator.\n",
     ["no plain form after its title"]),
    ("Decoupled (Yeh et al. 2022).\n\nInfoNCE without the positive; eps = 0 gives SINCERE.\n",
     ["no plain form after its title"]),
    ("Decoupled (Yeh et al. 2022).\n\nInfoNCE, where tau=0.1 by default.\n",
     ["no plain form after its title"]),
    ("Decoupled (eq. 1).\n\nloss_i = lse_{j in Neg(i)}(s_ij/tau) - s_ip/tau\n",
     ["no paper cited in its title"]),
    ("Decoupled (Yeh et al. 2022, eq. 6).\n\nloss_i = lse_{j in Neg(i)}(s_ij/tau) - s_ip/tau\n",
     []),
])
def test_an_opening_without_paper_or_form_is_found(opening, problems):
    assert opening_problems(opening) == problems
