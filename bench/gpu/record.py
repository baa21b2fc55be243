"""A GPU kit run as the record ``gpu/kit``, which ``docs/benchmarks.md`` cites a part at a
time (``bench/gpu/kit_tables.py``).

    python -m bench.gpu.record OUT_DIR    # OUT_DIR: where bash bench/gpu/run.sh wrote gpu.json

The record keeps each part's status, summary, rows and columns, and the run's provenance
(its command, date and GPU). A node that holds a copy of the tree but no git checkout
records no commit; the record then takes this checkout's, refused unless its tracked files
are unchanged and the digest of its source files is the one the node took of its copy
(``tree_sha256``, ``bench.records.tree_digest``). A
node's own checkout that differed from its commit, and a dry run, are refused.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from bench.records import REPO, git, tree_digest, write_and_show

NAME = "gpu/kit"
RENDERER = "bench.gpu.kit_tables"


def kit_provenance(report: dict[str, Any], cwd: Path = REPO) -> dict[str, Any]:
    """The run's provenance, with this checkout's commit where the node had none; raises
    ValueError naming what is wrong."""
    seen = dict(report["provenance"])
    if seen["dirty"]:
        raise ValueError(f"the node's checkout differed from its commit {seen['commit'][:7]}")
    if seen["commit"] is None:
        changed = git("status", "--porcelain", "--untracked-files=no", cwd=cwd)
        if changed is None:
            raise ValueError("the run names no commit and this is not a git checkout")
        if changed:
            raise ValueError("the run names no commit and this checkout's tracked files "
                             f"differ from HEAD ({changed.splitlines()[0].strip()}, ...): "
                             "record from the tree that was sent to the node")
        if report["tree_sha256"] != tree_digest(cwd):
            raise ValueError("the run names no commit and its tree_sha256 is not this "
                             "checkout's: the node ran another tree")
        seen.update(commit=git("rev-parse", "HEAD", cwd=cwd), dirty=False)
    return seen


def figures(report: dict[str, Any]) -> dict[str, Any]:
    """Each part's status, seconds, summary, rows, and its title and columns as the run
    had them (its log left out)."""
    return {"budget_s": report["budget_s"], "machine": report["machine"],
            "parts": {name: {"status": got["status"], "seconds": got["seconds"],
                             "summary": got.get("summary", ""), "rows": got.get("rows", []),
                             "title": got["title"], "columns": got["columns"]}
                      for name, got in report["parts"].items()}}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu.record",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the kit's OUT_DIR (holding gpu.json)")
    args = parser.parse_args(argv)
    path = args.out / "gpu.json"
    if not path.is_file():
        parser.error(f"{path}: no such file (the kit writes it as each part ends)")
    report = json.loads(path.read_text())
    if report.get("dry_run"):
        parser.error(f"{path}: a dry run measures nothing; record a run on a GPU")
    try:
        seen = kit_provenance(report)
    except ValueError as error:
        parser.error(f"{path}: {error}")
    first = next(iter(report["parts"]), None)
    if first is None:
        parser.error(f"{path}: no part finished")
    write_and_show(NAME, seen, RENDERER, figures(report), first)


if __name__ == "__main__":
    main()
