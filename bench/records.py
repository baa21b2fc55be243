"""Result records: what a benchmark run measured, with the command, commit, date and
machine that measured it, kept in the repository under ``bench/records/`` so that a figure
in the docs can cite it.

A record is JSON: ``{"command", "commit", "dirty", "date", "machine", "renderer",
"figures"}``; ``renderer`` names the module whose ``VIEWS`` maps each view's name to a
function ``(record) -> list[str]`` that turns the figures into the Markdown a page shows.
The provenance is taken when a run starts (``provenance(invocation())``), so that editing
the tree while it runs does not change what it says it measured. A page cites a record
around the lines it shows::

    <!-- record: learning/xclr_levers levers -->
    | lever | ... |
    <!-- /record -->

and ``tests/bench/test_records.py`` holds every cited block to its record's rendering, and
every record's commit to an ancestor of HEAD.
"""

from __future__ import annotations

import datetime
import hashlib
import importlib
import json
import os
import platform
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RECORDS = REPO / "bench" / "records"
CITATION = re.compile(r"<!-- record: (?P<name>[\w./-]+) (?P<view>\w+) -->\n(?P<body>.*?)"
                      r"<!-- /record -->", re.S)


def git(*args: str, cwd: Path = REPO) -> str | None:
    """``git args`` in ``cwd``'s checkout, its output stripped; None outside a checkout."""
    done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True,
                          check=False)
    return done.stdout.strip() if done.returncode == 0 else None


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def invocation() -> list[str]:
    """This process's command line as typed: ``python -m <module> <args>``."""
    script = Path(sys.argv[0]).resolve()
    try:
        parts = script.relative_to(REPO).with_suffix("").parts
    except ValueError:
        return ["python", *sys.argv]
    module = ".".join(parts[:-1] if parts[-1] == "__main__" else parts)
    return ["python", "-m", module, *sys.argv[1:]]


def provenance(command: list[str], cwd: Path = REPO) -> dict[str, Any]:
    """Where a measurement comes from: the command, the checkout's commit (None outside
    a git checkout), whether tracked files differed from it (results the repository keeps,
    :data:`KEPT_OUTPUTS`, aside), the date (UTC) and the machine."""
    import torch

    commit = git("rev-parse", "HEAD", cwd=cwd)
    changed = git("status", "--porcelain", "--untracked-files=no", "--", ".",
                  *(f":(exclude){path}" for path in KEPT_OUTPUTS), cwd=cwd)
    return {"command": " ".join(command), "commit": commit,
            "dirty": bool(changed) if commit else None,
            "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d"),
            "machine": {"cpu": cpu_model(), "cores": torch.get_num_threads(),
                        "torch": torch.__version__,
                        "cuda": torch.cuda.get_device_name()
                        if torch.cuda.is_available() else None}}


SOURCE_SUFFIXES = (".py", ".sh", ".yaml", ".yml", ".toml")
# what benchmarks write into a checkout and the repository keeps: records, learning runs
KEPT_OUTPUTS = ("bench/records", "bench/learning/finished_runs")
# what runs write into a checkout (its .gitignore, and the kept outputs), not the code
NOT_SOURCE = ("bench/results", *KEPT_OUTPUTS, "bench/gpu/wheels", "runs", "mlruns", "data",
              "build")


def tree_digest(root: Path = REPO) -> str:
    """sha256 over the path and bytes of every source file under ``root`` (hidden folders,
    ``__pycache__`` and :data:`NOT_SOURCE` left out): equal on a node's copy of a tree and
    on the checkout it was copied from, with or without git."""
    sources = []
    for folder, subfolders, files in os.walk(root):
        here = Path(folder).relative_to(root)
        subfolders[:] = [d for d in subfolders if not d.startswith(".") and d != "__pycache__"
                         and (here / d).as_posix() not in NOT_SOURCE]
        sources += [(here / name).as_posix() for name in files if name.endswith(SOURCE_SUFFIXES)]
    digest = hashlib.sha256()
    for relative in sorted(sources):
        digest.update(relative.encode() + b"\0" + (root / relative).read_bytes() + b"\0")
    return digest.hexdigest()


def write_record(name: str, seen: dict[str, Any], renderer: str,
                 figures: dict[str, Any]) -> Path:
    """``bench/records/<name>.json``: ``figures`` with ``seen``, the provenance taken when
    the run that measured them started."""
    path = RECORDS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {**seen, "renderer": renderer, "figures": figures}
    path.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    return path


def write_and_show(name: str, seen: dict[str, Any], renderer: str, figures: dict[str, Any],
                   view: str) -> Path:
    """:func:`write_record`, then print the record as ``view`` and where it was written."""
    path = write_record(name, seen, renderer, figures)
    print(rendered(name, view), end="")
    print(f"record: {path}")
    return path


def source_line(record: dict[str, Any]) -> str:
    """Where a record's figures come from, as a page states it: the command, the machine,
    the date and the commit."""
    machine = record["machine"]
    where = machine["cuda"] or f"{machine['cpu']}, {machine['cores']} threads"
    commit = (record["commit"] or "no commit")[:7] + (" with changes" if record["dirty"] else "")
    return (f"`{record['command']}`; {where}, torch {machine['torch']}, {record['date']}, "
            f"{commit}.")


def read_record(name: str) -> dict[str, Any]:
    return json.loads((RECORDS / f"{name}.json").read_text())


@dataclass(frozen=True)
class Citation:
    """A block of a page that shows record ``name`` as its ``view``."""

    page: Path
    line: int
    name: str
    view: str
    body: str


def citations(page: Path) -> list[Citation]:
    text = page.read_text()
    return [Citation(page, text.count("\n", 0, m.start()) + 1, m["name"], m["view"], m["body"])
            for m in CITATION.finditer(text)]


def views_of(record: dict[str, Any]) -> dict[str, Any]:
    """The views a record's renderer offers: name -> function of the record."""
    return importlib.import_module(record["renderer"]).VIEWS


def rendered(name: str, view: str) -> str:
    """What record ``name`` shows as ``view``, by its renderer."""
    record = read_record(name)
    views = views_of(record)
    if view not in views:
        raise ValueError(f"{name}: no view {view!r} ({', '.join(views)})")
    return "\n".join(views[view](record)) + "\n"


def unparsed(page: Path) -> list[str]:
    """Lines of ``page`` that open or close a cited block the citation pattern does not
    read (a stray space, another line ending, a missing close): a block never checked."""
    text = page.read_text()
    opened = [m.start() for m in re.finditer(r"<!-- ?record", text)]
    closed = [m.start() for m in re.finditer(r"<!-- ?/record", text)]
    read = {m.start() for m in CITATION.finditer(text)}
    ends = {m.end() - len("<!-- /record -->") for m in CITATION.finditer(text)}
    return [f"{page.name}:{text.count(chr(10), 0, at) + 1}: a record marker not read"
            for at in [*(o for o in opened if o not in read), *(c for c in closed
                                                              if c not in ends)]]


def mismatches(pages: list[Path]) -> list[str]:
    """One line per cited block of ``pages`` that differs from its record's rendering, and
    per record marker the citation pattern does not read."""
    found = [line for page in pages for line in unparsed(page)]
    for citation in (c for page in pages for c in citations(page)):
        page = (citation.page.relative_to(REPO) if citation.page.is_relative_to(REPO)
                else citation.page)
        if not (RECORDS / f"{citation.name}.json").is_file():
            found.append(f"{page}:{citation.line}: cites {citation.name}, which is not kept "
                         f"(bench/records/{citation.name}.json)")
            continue
        expected = rendered(citation.name, citation.view)
        if citation.body != expected:
            found.append(f"{page}:{citation.line}: the block "
                         f"shows {citation.name} {citation.view} otherwise than its record "
                         "(write it from the record: python -m bench.records --write)")
    return found


def write_citations(pages: list[Path]) -> None:
    """Rewrite every cited block of ``pages`` from its record (a block whose record is not
    kept stays as it is)."""
    for page in pages:
        text = page.read_text()

        def block(m: re.Match[str]) -> str:
            if not (RECORDS / f"{m['name']}.json").is_file():
                return m[0]  # named by mismatches
            return (f"<!-- record: {m['name']} {m['view']} -->\n"
                    f"{rendered(m['name'], m['view'])}<!-- /record -->")

        page.write_text(CITATION.sub(block, text))


def records() -> list[str]:
    """The names of every record kept."""
    return sorted(p.relative_to(RECORDS).with_suffix("").as_posix()
                  for p in RECORDS.rglob("*.json"))


def commits(record: dict[str, Any]) -> set[str]:
    """The commits a record names: its own, and any a figure carries as ``commit``."""
    found = {record["commit"]} if record.get("commit") else set()

    def walk(value: Any) -> None:
        if isinstance(value, dict):
            if isinstance(value.get("commit"), str):
                found.add(value["commit"])
            value = list(value.values())
        if isinstance(value, list):
            for item in value:
                walk(item)

    walk(record.get("figures"))
    return found


STATISTIC = re.compile(r"[+-]?\d+(?:\.\d+)?\s*(?:±|\+/-)\s*\d+(?:\.\d+)?")  # mean ± sd
UNRECORDED = "no record holds"  # what a table's or list's lead paragraph says, or a paragraph
CODE_BLOCK = re.compile(r"^```.*?^```", re.S | re.M)
NAMED = re.compile(r"`([\w.-]+/[\w.-]+)`")  # a record named in prose: `learning/main`


def _unrecorded(text: str) -> bool:
    return UNRECORDED in " ".join(text.lower().split())


def _statistic(found: str) -> str:
    mean, sd = re.split(r"\s*(?:±|\+/-)\s*", found)
    return f"{mean} ± {sd}"


def shown_anywhere(name: str) -> str:
    """Every view of record ``name`` as its renderer shows it, one after another."""
    record = read_record(name)
    return "\n".join("\n".join(view(record)) for view in views_of(record).values())


FIGURE = re.compile(r"(?<![\w.])[+-]?\d+\.\d{3}(?!\d|\.\d)")  # 0.931: three decimals, measured
INLINE_CODE = re.compile(r"`[^`]*`")  # a key or command (`objective.temperature=0.1`)


def _shows(text: str, figure: str) -> bool:
    """Whether ``text`` shows ``figure`` whole: not 0.074 inside -0.074, nor 7 inside 7.6."""
    return re.search(rf"(?<![\d.+-]){re.escape(figure)}(?!\d|\.\d)", text) is not None


def _prose(paragraph: str, where: str, lead: str = "") -> list[str]:
    """A paragraph's figures that no record it (or the lead of its list) names shows: each
    mean ± sd, and where it names a record each figure of three decimals too; one that
    names none shows its means ± sd from nowhere. Saying that no record holds it exempts the
    whole paragraph; a name of a record group (`learning/...`) that is not kept is named."""
    if _unrecorded(paragraph) or _unrecorded(lead):
        return []
    groups = {group.name for group in RECORDS.iterdir() if group.is_dir()}
    names = [n for n in NAMED.findall(f"{lead}\n{paragraph}") if n.split("/")[0] in groups]
    missing = [n for n in names if not (RECORDS / f"{n}.json").is_file()]
    if missing:
        return [f"{where}: names {n}, which is not kept" for n in missing]
    text = INLINE_CODE.sub("", paragraph)
    statistics = [_statistic(m) for m in STATISTIC.findall(text)]
    if not names:
        return [f"{where}: {figure} (no record named)" for figure in statistics]
    shown = "\n".join(map(shown_anywhere, names))
    alone = FIGURE.findall(STATISTIC.sub("", text))
    return [f"{where}: {figure} (not in {', '.join(names)})"
            for figure in [*statistics, *alone] if not _shows(shown, figure)]


def hand_statistics(page: Path) -> list[str]:
    """Figures on ``page`` outside a cited block that no record backs, one line each: a
    mean ± sd in a table row under a lead paragraph (the last one before the table) that
    does not say no record holds it; a prose paragraph's figures, and a list item's with
    its list's lead paragraph, as :func:`_prose` reads them (a record named as
    `group/name`). Other figures in prose that names no record are not read."""
    text = CODE_BLOCK.sub("", CITATION.sub("", page.read_text()))
    found, heading, lead = [], "(top)", ""
    for block in re.split(r"\n\s*\n", text):
        lines = block.strip().splitlines()
        if not lines:
            continue
        if lines[0].startswith("#"):
            heading, lead = lines[0], ""
            lines = lines[1:]
        where = f"{page.name}, {heading}"
        if lines and all(line.lstrip().startswith("|") for line in lines):
            if not _unrecorded(lead):
                found += [f"{where}: {line.strip()[:60]}" for line in lines
                          if STATISTIC.search(line)]
        elif lines and lines[0].startswith(("- ", "* ")):
            items = re.split(r"\n(?=[-*] )", "\n".join(lines))
            found += [line for item in items for line in _prose(item, where, lead)]
        elif lines:
            lead = " ".join(lines)
            found += _prose(lead, where)
    return found


def pages() -> list[Path]:
    """The pages that may cite records: the README and docs/."""
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Check, or write, the docs' cited blocks "
                                                 "from their records.")
    parser.add_argument("--write", action="store_true", help="rewrite the blocks")
    args = parser.parse_args()
    if args.write:
        write_citations(pages())
    problems = mismatches(pages())
    print("\n".join(problems) or "every cited block equals its record")
    raise SystemExit(1 if problems else 0)
