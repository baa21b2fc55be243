"""Every loss is written in one vocabulary (``pretrain/contrast/vocabulary.py``) and imports
nothing else of the objectives or their machinery but the loss it is a case of, in any
import form (absolute, relative, ``importlib``); each name of it is documented on "Writing
a loss" (docs/architecture.md). Its six core names serve more than one loss (the toy
among them); each of its six objective-specific operations serves exactly one."""

from __future__ import annotations

import ast
import importlib.util
import inspect
from pathlib import Path

import pytest

import pretrain.contrast.vocabulary as vocabulary
from pretrain.objectives import OBJECTIVES

LOSS_FILES = sorted({Path(inspect.getfile(spec.fn)).stem for spec in OBJECTIVES.values()})
TOY = Path("tests/pretrain/objectives/toy_decoupled.py")  # test_toy_objective.py's new loss


PACKAGES = ("pretrain.objectives", "pretrain.contrast")  # the objectives and their machinery


def imported_modules(tree: ast.AST, package: str) -> dict[str, set[str]]:
    """{module: names} for every import form in ``tree`` of a module in ``package``:
    ``import a.b``, ``from a.b import c`` (a submodule ``c`` counted as a module), relative
    ``from .b import c`` and ``from . import b``, and ``importlib.import_module`` /
    ``__import__`` of a constant name."""
    found: dict[str, set[str]] = {}
    loaders = {"import_module", "__import__"} | {  # and import_module under another name
        alias.asname for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
        and node.module == "importlib" for alias in node.names
        if alias.name == "import_module" and alias.asname}

    def add(module: str, name: str) -> None:
        found.setdefault(module, set()).add(name)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, "*")
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[:len(package.split(".")) - node.level + 1] \
                if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            for alias in node.names:
                add(module, alias.name)
                add(f"{module}.{alias.name}", "*")  # the name may be a submodule
        elif isinstance(node, ast.Call) and node.args \
                and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str) \
                and ast.unparse(node.func).split(".")[-1] in loaders:
            add(dynamic_target(node), "*")
    return found


def dynamic_target(call: ast.Call) -> str:
    """The module an ``import_module(name, package)`` or ``__import__`` call names, a
    relative name resolved against a constant package."""
    name = call.args[0].value
    package = call.args[1] if len(call.args) > 1 else next(
        (k.value for k in call.keywords if k.arg == "package"), None)
    if name.startswith(".") and isinstance(package, ast.Constant):
        return importlib.util.resolve_name(name, package.value)
    return name


def imports(stem: str) -> dict[str, set[str]]:
    """{module of the objectives or their machinery: names} that
    ``pretrain/objectives/<stem>.py`` (or the toy's file) imports, in any form; a name that
    is not a module of those packages is dropped."""
    path = TOY if stem == TOY.stem else Path(f"pretrain/objectives/{stem}.py")
    found = imported_modules(ast.parse(path.read_text()), ".".join(path.parent.parts))
    return {module: names for module, names in found.items()
            if module in PACKAGES or (module.startswith(tuple(f"{p}." for p in PACKAGES))
                                      and is_module(module))}


def is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a name inside a module, not a submodule
        return False


def test_the_vocabulary_is_small_and_every_name_is_on_the_page():
    page = Path("docs/architecture.md").read_text()
    section = page[page.index("## Writing a loss"):]
    section = section[:section.index("\n## ", 3)]
    assert len(vocabulary.CORE) <= 6 and len(vocabulary.ONE_OBJECTIVE) <= 6
    missing = [name for name in vocabulary.__all__ if f"`{name}" not in section]
    assert not missing, f"names of the vocabulary not on 'Writing a loss': {missing}"


@pytest.mark.parametrize("stem", [*LOSS_FILES, TOY.stem])
def test_a_loss_imports_the_vocabulary_and_nothing_else_of_the_package(stem):
    """... beside the loss it is a case of (InfoNCE of SupCon, eps-SupInfoNCE of SINCERE)."""
    losses = {f"pretrain.objectives.{other}" for other in LOSS_FILES}
    found = set(imports(stem)) - losses
    assert found == {"pretrain.contrast.vocabulary"}, f"{stem}.py imports {sorted(found)}"


def test_each_core_name_serves_more_than_one_loss():
    users = {name: [stem for stem in [*LOSS_FILES, TOY.stem]
                    if name in imports(stem).get("pretrain.contrast.vocabulary", set())]
             for name in vocabulary.CORE}
    assert all(len(stems) >= 2 for stems in users.values()), users


def test_each_objective_specific_reduction_serves_one_loss():
    users = {name: [stem for stem in LOSS_FILES
                    if name in imports(stem).get("pretrain.contrast.vocabulary", set())]
             for name in vocabulary.ONE_OBJECTIVE}
    assert all(len(stems) == 1 for stems in users.values()), users
