"""The learning benchmark's finished runs, kept in the repository (``--keep``).

The main part alone is 81 runs, more than one sitting on 2 CPU cores. With ``--keep`` each
run's ``result.json`` (its figures and provenance: command, commit, date, machine) is
copied to ``bench/learning/finished_runs/<name>.json`` when it finishes, and a kept run is
restored into the run folder instead of trained again when its configuration equals the
table's, its recipe holds the values it held at its commit (comments aside) and the data
code is unchanged since, so a benchmark committed part by part continues from another
checkout.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import yaml

from bench.learning.runs import REPO, Configuration, result_path
from bench.records import git
from core.config import read_yaml

FINISHED = REPO / "bench" / "learning" / "finished_runs"
# what makes a run's data, beside its recipe: unchanged since a kept run's commit
DATA_SOURCES = ("bench/learning/data.py", "data_pipeline/cluttered.py",
                "data_pipeline/alt_text.py")


def kept(name: str, folder: Path | None = None) -> dict[str, Any] | None:
    """The run ``name`` as kept in ``folder`` (:data:`FINISHED`), or None (said so when the
    file is not a kept run)."""
    path = (folder or FINISHED) / f"{name}.json"
    if not path.is_file():
        return None
    try:
        result = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError):
        result = None
    if not isinstance(result, dict) or not isinstance(result.get("configuration"), dict):
        print(f"{path}: not a kept run (no JSON object with a configuration); trained again")
        return None
    return result


def same_configuration(result: dict[str, Any], conf: Configuration) -> bool:
    return result.get("configuration") == json.loads(json.dumps(dataclasses.asdict(conf)))


def unchanged_since(commit: str | None, conf: Configuration) -> bool:
    """Whether ``conf``'s recipe holds the values it held at ``commit`` (its comments may
    have changed) and the data code is as it was."""
    if not commit:
        return False
    then, now = git("show", f"{commit}:{conf.recipe}", cwd=REPO), REPO / conf.recipe
    if then is None or not now.is_file():
        return False
    try:  # each value as written: 1 and 1.0 differ, as they may for the field they set
        same_values = read_yaml(then) == read_yaml(now.read_text())
    except yaml.YAMLError:
        return False
    return same_values and git("diff", "--quiet", str(commit), "--", *DATA_SOURCES,
                               cwd=REPO) is not None


def restore(conf: Configuration, root: Path, folder: Path | None = None) -> bool:
    """Copy the kept run of ``conf`` into ``root``'s run folder unless one is there; a kept
    run of another configuration, or of a recipe or data since changed, is left, and said
    so."""
    folder = folder or FINISHED
    target = result_path(conf, root)
    result = kept(conf.name, folder)
    if target.is_file() or result is None:
        return False
    path = folder / f"{conf.name}.json"
    commit = (result.get("provenance") or {}).get("commit")
    if not same_configuration(result, conf):
        print(f"{path}: kept for another configuration than the table's {conf.name}; "
              "trained again")
        return False
    if not unchanged_since(commit, conf):
        print(f"{path}: its recipe or data code changed since {str(commit)[:7]}; trained again")
        return False
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(path, target)
    return True


def keep(conf: Configuration, root: Path, folder: Path | None = None) -> bool:
    """Copy a finished run of ``conf`` to ``folder`` (:data:`FINISHED`) when it is of the
    table's configuration and a commit of a clean tree made it (a record names that
    commit); returns whether it was kept."""
    folder = folder or FINISHED
    source = result_path(conf, root)
    if not source.is_file():
        return False
    result = json.loads(source.read_text())
    seen = result.get("provenance") or {}
    why = ("of another configuration than the table's" if not same_configuration(result, conf)
           else "made from no git checkout" if not seen.get("commit")
           else "made from a changed tree" if seen.get("dirty") else None)
    if why:
        print(f"{source}: not kept: {why}")
        return False
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, folder / f"{conf.name}.json")
    return True
