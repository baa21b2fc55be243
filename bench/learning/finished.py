"""The learning benchmark's finished runs, kept in the repository (``--keep``).

The main part alone is 81 runs, more than one sitting on 2 CPU cores. With ``--keep`` each
run's ``result.json`` (its figures and provenance: command, commit, date, machine) is
copied to ``bench/learning/finished_runs/<name>.json`` when it finishes, and a kept run
whose configuration equals the table's is restored into the run folder instead of trained
again, so a benchmark committed part by part continues from another checkout.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

from bench.learning.runs import REPO, Configuration

FINISHED = REPO / "bench" / "learning" / "finished_runs"


def kept(name: str, folder: Path | None = None) -> dict[str, Any] | None:
    """The run ``name`` as kept in ``folder`` (:data:`FINISHED`), or None."""
    path = (folder or FINISHED) / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def result_path(conf: Configuration, root: Path) -> Path:
    return root / "runs" / conf.name / "result.json"


def restore(conf: Configuration, root: Path, folder: Path | None = None) -> bool:
    """Copy the kept run of ``conf`` into ``root``'s run folder unless one is there; a kept
    run of another configuration (the table changed since) is left, and said so."""
    folder = folder or FINISHED
    target = result_path(conf, root)
    result = kept(conf.name, folder)
    if target.is_file() or result is None:
        return False
    if result.get("configuration") != json.loads(json.dumps(dataclasses.asdict(conf))):
        print(f"{folder / conf.name}.json: kept for another configuration than the table's "
              f"{conf.name}; trained again")
        return False
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(folder / f"{conf.name}.json", target)
    return True


def keep(conf: Configuration, root: Path, folder: Path | None = None) -> bool:
    """Copy a finished run of ``conf`` to ``folder`` (:data:`FINISHED`) when a commit of a
    clean tree made it (a record names that commit); returns whether it was kept."""
    folder = folder or FINISHED
    source = result_path(conf, root)
    if not source.is_file():
        return False
    seen = json.loads(source.read_text()).get("provenance") or {}
    if not seen.get("commit") or seen.get("dirty"):
        print(f"{source}: not kept: made from "
              f"{'a changed tree' if seen.get('commit') else 'no git checkout'}")
        return False
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, folder / f"{conf.name}.json")
    return True
