"""Every loss is written in one vocabulary (``pretrain/losses/vocabulary.py``), each of its
names documented on "Writing a loss" (docs/architecture.md); what a loss takes from the
internals beside it is listed here, so that the list only shrinks on purpose."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import pretrain.losses.vocabulary as vocabulary
from pretrain.losses import OBJECTIVES

INTERNALS = {"batch", "columns", "common", "rows", "tiles", "pair_tiles", "sigmoid_rows",
             "projections", "soft_targets"}
# loss file -> the internal names it takes beyond the vocabulary (and why: architecture.md)
BEYOND = {
    "xclr": {"soft_target_rows"},
    "projnce": {"ClassProjection", "KernelMetric", "projected_rows"},
    "clip": {"both_directions"},
    "siglip": {"sigmoid_rows"},
    "sincere": {"row_logsumexp_and_pair_terms"},
}
LOSS_FILES = sorted({Path(inspect.getfile(spec.fn)).stem for spec in OBJECTIVES.values()})


def imports(stem: str) -> dict[str, set[str]]:
    """{module of pretrain.losses: names} that ``pretrain/losses/<stem>.py`` imports."""
    tree = ast.parse(Path(f"pretrain/losses/{stem}.py").read_text())
    found: dict[str, set[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module.startswith("pretrain.losses."):
            found.setdefault(node.module.rsplit(".", 1)[1], set()).update(
                alias.name for alias in node.names)
    return found


def test_the_vocabulary_is_small_and_every_name_is_on_the_page():
    page = Path("docs/architecture.md").read_text()
    section = page[page.index("## Writing a loss"):]
    section = section[:section.index("\n## ", 3)]
    assert len(vocabulary.__all__) <= 8  # four types, four operations
    missing = [name for name in vocabulary.__all__ if f"`{name}" not in section]
    assert not missing, f"names of the vocabulary not on 'Writing a loss': {missing}"


@pytest.mark.parametrize("stem", LOSS_FILES)
def test_a_loss_takes_its_machinery_from_the_vocabulary(stem):
    found = imports(stem)
    assert "vocabulary" in found, f"{stem}.py does not import the vocabulary"
    beyond = set().union(*(names for module, names in found.items() if module in INTERNALS))
    assert beyond == BEYOND.get(stem, set()), f"{stem}.py beyond the vocabulary: {beyond}"
