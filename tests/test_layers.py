"""The packages form layers that import one way only (docs/architecture.md):

    core  <  data_pipeline  <  pretrain  <  registry  <  serving  <  evaluation  <  app

A module may import from its own layer and the ones below, never above; models and
losses never touch torch.distributed (the gathering boundary does). Within ``pretrain``
each sub-package imports only the sub-packages its docstring names (``SUBPACKAGES``).
Every import counts, also one inside a function."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from data_pipeline.graph.tasks import TASKS
from data_pipeline.loader.backends import BACKENDS
from data_pipeline.sources import SOURCES
from pretrain.distributed.engine import ENGINES
from pretrain.loop.optim import OPTIMIZERS
from pretrain.model.backbones import BACKBONES, TIMM, TIMM_FAMILY
from pretrain.objectives.table import OBJECTIVES

REPO = Path(__file__).resolve().parents[1]
LAYERS = ["core", "data_pipeline", "pretrain", "registry", "serving", "evaluation", "app"]
# the benchmarks' folders, by subject (bench/__init__.py), and the helpers they share
BENCH_SUBJECTS = {"perf", "scale", "soak", "gpu", "learning"}
BENCH_SHARED = {"__init__.py", "common.py", "processes.py", "records.py", "records"}
NO_DISTRIBUTED = ["pretrain/objectives", "pretrain/contrast", "pretrain/model"]
# each sub-package of pretrain -> the sub-packages of pretrain it may import (itself included)
SUBPACKAGES = {
    "contrast": {"contrast"},
    "objectives": {"objectives", "contrast"},
    "distributed": {"distributed", "objectives", "contrast", "run"},
    "model": {"model", "objectives", "contrast"},
    "run": {"run"},
    "loop": {"loop", "model", "run", "distributed", "objectives", "contrast"},
}


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in ``path``, relative imports resolved."""
    tree = ast.parse(path.read_text(), str(path))
    package = ".".join(path.relative_to(REPO).with_suffix("").parts[:-1])
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def modules(layer: str) -> list[Path]:
    return sorted((REPO / layer).rglob("*.py"))


# the benchmarks and the tests stand above every layer
ABOVE_ALL = ("bench", "tests")


def upward_imports(path: Path, layer: str) -> list[str]:
    allowed = set(LAYERS[: LAYERS.index(layer) + 1])
    return [f"{path.relative_to(REPO)}:{line} imports {module}"
            for line, module in imported_modules(path)
            if module.split(".")[0] in (*LAYERS, *ABOVE_ALL)
            and module.split(".")[0] not in allowed]


@pytest.mark.parametrize("layer", LAYERS)
def test_no_module_imports_from_a_layer_above(layer):
    assert modules(layer), f"layer {layer} has no modules"
    violations = [v for path in modules(layer) for v in upward_imports(path, layer)]
    assert not violations, "\n".join(violations)


def registry_methods() -> set[str]:
    """MlflowClient's methods on the model registry (versions, registered models, aliases
    and their tags), and mlflow's own ``register_model``."""
    from mlflow import MlflowClient

    return {name for name in dir(MlflowClient) if not name.startswith("_") and (
        "model_version" in name or "registered_model" in name)} | {
        "get_latest_versions", "register_model"}


REGISTRY_CALLS = registry_methods()


def registry_calls(path: Path, root: Path = REPO) -> list[str]:
    """Where ``path`` calls the model registry: a method or function named in
    REGISTRY_CALLS, or a call that registers as it logs (``registered_model_name=``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Call):
            continue
        name = (node.func.attr if isinstance(node.func, ast.Attribute)
                else node.func.id if isinstance(node.func, ast.Name) else None)
        if name in REGISTRY_CALLS:
            found.append(f"{path.relative_to(root)}:{node.lineno} calls {name}")
        if any(k.arg == "registered_model_name" for k in node.keywords):
            found.append(f"{path.relative_to(root)}:{node.lineno} registers through {name}")
    return found


def test_only_the_registry_layer_calls_the_model_registry():
    assert registry_calls(REPO / "registry" / "promote.py"), "the check sees no call at all"
    violations = [v for layer in LAYERS if layer != "registry"
                  for path in modules(layer) for v in registry_calls(path)]
    assert not violations, "\n".join(violations)


def test_the_registry_check_sees_a_registry_call_elsewhere(tmp_path):
    planted = tmp_path / "evaluation" / "tag.py"
    planted.parent.mkdir()
    planted.write_text("from mlflow import register_model\n\n\ndef tag(client, log_model):\n"
                       "    client.set_model_version_tag('m', '1', 'k', 'v')\n"
                       "    client.get_registered_model('m')\n"
                       "    register_model('runs:/r/encoder', 'm')\n"
                       "    log_model(name='encoder', registered_model_name='m')\n")
    assert sorted(registry_calls(planted, tmp_path)) == [
        "evaluation/tag.py:5 calls set_model_version_tag",
        "evaluation/tag.py:6 calls get_registered_model",
        "evaluation/tag.py:7 calls register_model",
        "evaluation/tag.py:8 registers through log_model"]


# what lives under torch.distributed but communicates with no one
NOT_COMMUNICATION = ("torch.distributed.algorithms._checkpoint.checkpoint_wrapper",)


def test_models_and_losses_never_call_torch_distributed():
    paths = [p for target in NO_DISTRIBUTED for p in
             ((REPO / target).rglob("*.py") if (REPO / target).is_dir() else [REPO / target])]
    assert paths
    violations = [f"{p.relative_to(REPO)}:{line} imports {module}" for p in paths
                  for line, module in imported_modules(p)
                  if module.startswith(("torch.distributed", "core.collectives"))
                  and not module.startswith(NOT_COMMUNICATION)]
    assert not violations, "\n".join(violations)


# sub-packages of pretrain that import no lower layer but core (their docstrings say so)
CORE_ONLY = {"contrast", "objectives"}


def subpackage_violations(path: Path) -> list[str]:
    """The imports of ``path`` (a module under pretrain/<sub-package>/) of sub-packages
    of pretrain its own may not import, and, for a core-only sub-package, of any lower
    layer but ``core``."""
    own = path.relative_to(REPO / "pretrain").parts[0]
    lower = set(LAYERS[:LAYERS.index("pretrain")]) - {"core"} if own in CORE_ONLY else set()
    return [f"{path.relative_to(REPO)}:{line} imports {module}"
            for line, module in imported_modules(path)
            if (module.startswith("pretrain.") and module.split(".")[1] not in SUBPACKAGES[own])
            or module.split(".")[0] in lower]


def test_pretrain_holds_its_sub_packages_and_nothing_else():
    entries = {p.name for p in (REPO / "pretrain").iterdir() if p.name != "__pycache__"}
    assert entries == {"__init__.py", *SUBPACKAGES}
    for name in SUBPACKAGES:
        doc = ast.get_docstring(ast.parse((REPO / "pretrain" / name / "__init__.py").read_text()))
        assert doc and "May import" in doc, f"pretrain/{name}/__init__.py states no role"


@pytest.mark.parametrize("subpackage", sorted(SUBPACKAGES))
def test_a_pretrain_sub_package_imports_only_what_its_role_allows(subpackage):
    paths = sorted((REPO / "pretrain" / subpackage).rglob("*.py"))
    assert paths
    violations = [v for path in paths for v in subpackage_violations(path)]
    assert not violations, "\n".join(violations)


def test_the_sub_package_check_sees_an_objective_importing_the_data_pipeline(monkeypatch):
    bad = REPO / "pretrain" / "objectives" / "_layer_probe.py"
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: (
        "import data_pipeline.text\n" if self == bad else Path.read_bytes(self).decode()))
    assert subpackage_violations(bad) == [
        "pretrain/objectives/_layer_probe.py:1 imports data_pipeline.text"]


def test_the_sub_package_check_sees_a_model_importing_the_loop(monkeypatch):
    bad = REPO / "pretrain" / "model" / "_layer_probe.py"
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: (
        "from pretrain.run.checkpoint import Checkpointer\n" if self == bad
        else Path.read_bytes(self).decode()))
    assert subpackage_violations(bad) == [
        "pretrain/model/_layer_probe.py:1 imports pretrain.run.checkpoint",
        "pretrain/model/_layer_probe.py:1 imports pretrain.run.checkpoint.Checkpointer"]


def test_the_check_sees_an_upward_import(tmp_path, monkeypatch):
    """The test itself can fail: a data module importing the trainer is caught."""
    bad = REPO / "data_pipeline" / "_layer_probe.py"
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: (
        "def f():\n    from pretrain.loop.trainer import Trainer\n" if self == bad
        else Path.read_bytes(self).decode()))
    assert upward_imports(bad, "data_pipeline") == [
        "data_pipeline/_layer_probe.py:2 imports pretrain.loop.trainer",
        "data_pipeline/_layer_probe.py:2 imports pretrain.loop.trainer.Trainer"]


@pytest.mark.parametrize("above", ABOVE_ALL)
def test_the_check_sees_a_layer_importing_the_benchmarks_or_the_tests(above, monkeypatch):
    bad = REPO / "app" / "_layer_probe.py"
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: (
        f"from {above}.common import helper\n" if self == bad
        else Path.read_bytes(self).decode()))
    assert upward_imports(bad, "app") == [f"app/_layer_probe.py:1 imports {above}.common",
                                          f"app/_layer_probe.py:1 imports {above}.common.helper"]


def module_file(name: str) -> Path | None:
    """The file that defines module ``name`` in this repository, or None (a third-party
    module, or an attribute of a module rather than a module)."""
    path = REPO.joinpath(*name.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def import_graph() -> dict[Path, set[Path]]:
    """Each module of the layers and of ``bench`` -> the modules of those it imports, each
    import resolved to the most specific module it names (``from a.b import c``:
    ``a/b/c.py`` when that file exists, else ``a/b``)."""
    graph: dict[Path, set[Path]] = {}
    roots = [*LAYERS, "bench"]
    for layer in roots:
        for path in modules(layer):
            targets = {module_file(module) for _, module in imported_modules(path)
                       if module.split(".")[0] in roots}
            graph[path] = {t for t in targets if t is not None and t != path}
    return graph


def import_cycles(graph: dict[Path, set[Path]]) -> list[list[Path]]:
    """The strongly connected components of more than one module (Tarjan's algorithm):
    each is a set of modules that import each other, directly or through others."""
    index: dict[Path, int] = {}
    low: dict[Path, int] = {}
    stack: list[Path] = []
    cycles: list[list[Path]] = []

    def visit(node: Path) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def test_no_import_circles():
    """No two modules import each other, directly or through others; an import inside a
    function counts, since it only defers the circle."""
    cycles = import_cycles(import_graph())
    assert not cycles, "\n".join(" <-> ".join(str(p.relative_to(REPO)) for p in cycle)
                                 for cycle in cycles)


def test_the_circle_check_sees_a_circle():
    a, b, c = (REPO / name for name in ("a.py", "b.py", "c.py"))
    assert import_cycles({a: {b}, b: {c}, c: {a}}) == [[a, b, c]]
    assert import_cycles({a: {b}, b: {c}, c: set()}) == []


def test_bench_holds_its_subject_folders_and_their_shared_helpers():
    entries = {p.name for p in (REPO / "bench").iterdir()
               if p.name not in ("__pycache__", "results")}
    assert BENCH_SUBJECTS <= entries <= BENCH_SUBJECTS | BENCH_SHARED, (
        entries ^ (BENCH_SUBJECTS | BENCH_SHARED))
    for subject in BENCH_SUBJECTS:
        doc = ast.get_docstring(ast.parse((REPO / "bench" / subject / "__init__.py").read_text()))
        assert doc, f"bench/{subject}/__init__.py says not what it measures"


def test_tests_mirror_the_package_layout():
    """Every folder of tests/ is the test folder of a folder of the repository."""
    folders = [p for p in (REPO / "tests").rglob("*") if p.is_dir() and p.name != "__pycache__"]
    assert folders
    unmatched = [str(p.relative_to(REPO)) for p in folders
                 if not (REPO / p.relative_to(REPO / "tests")).is_dir()]
    assert not unmatched, f"test folders with no package folder: {unmatched}"


TABLES = {"pretrain/objectives/table.py": OBJECTIVES, "pretrain/model/backbones.py": BACKBONES,
          "pretrain/distributed/engine.py": ENGINES, "pretrain/loop/optim.py": OPTIMIZERS,
          "data_pipeline/sources.py": SOURCES, "data_pipeline/graph/tasks.py": TASKS,
          "data_pipeline/loader/backends.py": BACKENDS}


def name_checks(path: Path, names: set[str]) -> list[str]:
    """Comparisons of a value with one of ``names`` (``x == "deepspeed"``, ``x in
    ("clip", "siglip")``) and ``.startswith("timm:")`` in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Compare):
            consts = [n for side in (node.left, *node.comparators) for n in ast.walk(side)
                      if isinstance(n, ast.Constant) and n.value in names]
            found += [f"{path.relative_to(REPO)}:{node.lineno} compares with {c.value!r}"
                      for c in consts]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "startswith" and node.args
              and isinstance(node.args[0], ast.Constant) and node.args[0].value == TIMM):
            found.append(f"{path.relative_to(REPO)}:{node.lineno} checks the {TIMM} prefix")
    return found


def test_the_run_reads_table_entries_never_names():
    """No module of the layers outside a table's own checks a name of its entries: what an
    objective, a backbone or an engine needs comes from its entry (docs/architecture.md)."""
    names = {name for table in TABLES.values() for name in table} - {TIMM_FAMILY}
    owners = {REPO / p for p in TABLES}
    violations = [v for layer in LAYERS for path in modules(layer) if path not in owners
                  for v in name_checks(path, names)]
    assert not violations, "\n".join(violations)


def test_the_name_check_sees_a_name_check(monkeypatch):
    probe = REPO / "app" / "_probe.py"
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: (
        "if cfg.name == 'deepspeed' or b.startswith('timm:'):\n    pass\n" if self == probe
        else Path.read_bytes(self).decode()))
    assert name_checks(probe, {"deepspeed"}) == ["app/_probe.py:1 compares with 'deepspeed'",
                                                 "app/_probe.py:1 checks the timm: prefix"]


def objective_mentions(path: Path) -> list[str]:
    """Lines of ``path`` that name an objective of the table, in code or in words."""
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, OBJECTIVES)) + r")\b", re.IGNORECASE)
    return [f"{path.relative_to(REPO)}:{number}: {line.strip()}"
            for number, line in enumerate(path.read_text().splitlines(), 1)
            if pattern.search(line)]


def test_app_names_no_objective():
    """What an objective needs from the run (labels, a class graph, a text tower, loss
    parameters) is declared in its table entry and provided by generic code: the
    commands in ``app/`` name no objective, not even in a comment."""
    violations = [v for path in modules("app") for v in objective_mentions(path)]
    assert not violations, "\n".join(violations)


def test_the_mention_check_sees_an_objective_in_a_comment(monkeypatch):
    probe = REPO / "app" / "_probe.py"
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: (
        "graph = cfg.own.graph  # for X-CLR, i.e. xclr\n" if self == probe
        else Path.read_bytes(self).decode()))
    assert objective_mentions(probe) == ["app/_probe.py:1: graph = cfg.own.graph  "
                                         "# for X-CLR, i.e. xclr"]
