"""The production path of every objective (fused, tiled, without host reads: what a run
trains with) equals the plain form its table entry declares, in value and gradient, dense
and over column tiles, in float64, under every setting the entry lists."""

from __future__ import annotations

import re
import sys

import pytest
import torch

from pretrain.objectives import OBJECTIVES, batch_loss
from tests.objective_cases import case_ids, objective_cases
from tests.pretrain.objectives.conftest import make_multiview_batch

TAU = 0.2
CLASSES = 6  # the batch's labels lie in [0, 6), every class present
CASES = objective_cases()


@pytest.mark.parametrize("tile_size", [None, 5], ids=["dense", "tiled"])
@pytest.mark.parametrize("case", CASES, ids=case_ids(CASES))
@pytest.mark.parametrize("seed", [0, 1])
def test_the_production_path_equals_the_plain_form(case, tile_size, seed):
    b = make_multiview_batch(seed)
    rows = case.rows(b.z, b.ids, b.labels, b.captions, b.text)
    keywords = case.keywords(CLASSES, b.z.shape[1], torch.float64)
    ours, _ = batch_loss(case.name, rows.z, rows.ids, rows.labels, captions=rows.captions,
                         text=rows.text, temperature=TAU, tile_size=tile_size, **keywords)
    reference = case.spec.plain(rows, TAU, **keywords)
    torch.testing.assert_close(ours, reference, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(b.grad_of(ours), b.grad_of(reference), rtol=1e-9, atol=1e-12)


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
