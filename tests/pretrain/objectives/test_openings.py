"""Each objective's file opens as docs/architecture.md asks: a title citing its paper, then
its plain mathematical form."""

from __future__ import annotations

import re
import sys

import pytest

from pretrain.objectives import OBJECTIVES

CITATION = re.compile(r"et al\.|eq\. \d|Def\. \d")  # a paper and where in it


def opening_problems(doc: str) -> list[str]:
    """What a module docstring lacks of an objective's opening: a title citing its paper,
    then, as the first line after it, its plain form (an equation, or a per-anchor loss)."""
    title, _, rest = doc.partition("\n\n")
    first = rest.splitlines()[0] if rest.strip() else ""
    return ([] if CITATION.search(title) else ["no paper cited in its title"]) + (
        [] if "=" in first or first.startswith("per anchor i:")
        else ["no plain form after its title"])


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_each_objective_file_opens_with_its_paper_and_plain_form(name):
    module = sys.modules[OBJECTIVES[name].plain.__module__]
    assert opening_problems(module.__doc__ or "") == [], module.__file__


def test_an_opening_in_words_only_is_found():
    assert opening_problems("Decoupled (Yeh et al. 2022).\n\nInfoNCE without the positive "
                            "in its denominator.\n") == [
        "no plain form after its title"]
    assert opening_problems("Decoupled.\n\nloss_i = -s_ip/tau + lse\n") == [
        "no paper cited in its title"]
