"""Every loss is written in one vocabulary (``pretrain/losses/vocabulary.py``) and imports
nothing else of the losses package but the loss it is a case of; each name of it is
documented on "Writing a loss" (docs/architecture.md). Its six core names serve every
loss; each of its three objective-specific reductions serves exactly one."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import pretrain.losses.vocabulary as vocabulary
from pretrain.losses import OBJECTIVES

LOSS_FILES = sorted({Path(inspect.getfile(spec.fn)).stem for spec in OBJECTIVES.values()})
TOY = Path("tests/pretrain/losses/toy_decoupled.py")  # test_toy_objective.py's new loss


def imports(stem: str) -> dict[str, set[str]]:
    """{module of pretrain.losses: names} that ``pretrain/losses/<stem>.py`` (or the toy's
    file) imports."""
    path = TOY if stem == TOY.stem else Path(f"pretrain/losses/{stem}.py")
    tree = ast.parse(path.read_text())
    found: dict[str, set[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module.startswith("pretrain.losses"):
            found.setdefault(node.module, set()).update(alias.name for alias in node.names)
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("pretrain.losses"):
                    found.setdefault(alias.name, set()).add("*")
    return found


def test_the_vocabulary_is_small_and_every_name_is_on_the_page():
    page = Path("docs/architecture.md").read_text()
    section = page[page.index("## Writing a loss"):]
    section = section[:section.index("\n## ", 3)]
    assert len(vocabulary.CORE) <= 6 and len(vocabulary.ONE_OBJECTIVE) <= 3
    missing = [name for name in vocabulary.__all__ if f"`{name}" not in section]
    assert not missing, f"names of the vocabulary not on 'Writing a loss': {missing}"


@pytest.mark.parametrize("stem", [*LOSS_FILES, TOY.stem])
def test_a_loss_imports_the_vocabulary_and_nothing_else_of_the_package(stem):
    """... beside the loss it is a case of (InfoNCE of SupCon, eps-SupInfoNCE of SINCERE)."""
    losses = {f"pretrain.losses.{other}" for other in LOSS_FILES}
    found = set(imports(stem)) - losses
    assert found == {"pretrain.losses.vocabulary"}, f"{stem}.py imports {sorted(found)}"


def test_each_objective_specific_reduction_serves_one_loss():
    users = {name: [stem for stem in LOSS_FILES
                    if name in imports(stem).get("pretrain.losses.vocabulary", set())]
             for name in vocabulary.ONE_OBJECTIVE}
    assert all(len(stems) == 1 for stems in users.values()), users
