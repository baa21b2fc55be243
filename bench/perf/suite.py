"""The test suite's size and time as a record, read off pytest's own summary line.

    .venv/bin/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder | tee suite.log
    .venv/bin/python -m bench.perf.suite suite.log          # in the checkout that ran it

Writes ``bench/records/perf/suite.json`` with the checkout's commit; its view ``summary`` is
the README's sentence. A log whose summary reports a failure or an error is refused: the
README states what a passing run takes.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

from bench.records import invocation, provenance, write_record

NAME = "perf/suite"
RENDERER = "bench.perf.suite"  # this module, by the name a record imports it
INTERRUPTED = re.compile(r"^!+ (KeyboardInterrupt|Interrupted)", re.M)
SUMMARY = re.compile(r"^=+ (?P<counts>.*?) in (?P<seconds>[\d.]+)s(?: \([\d:]+\))? =+$", re.M)


def summary(log: str) -> dict[str, Any]:
    """The counts (``passed``, ``skipped``, ...) and seconds of the last summary line."""
    found = list(SUMMARY.finditer(log))
    if not found:
        raise ValueError("no pytest summary line ('= ... in N s =') in the log")
    counts = {word: int(number) for number, word in
              re.findall(r"(\d+) (\w+)", found[-1]["counts"])}
    if INTERRUPTED.search(log):  # pytest's banner; its summary line does not say so
        counts["interrupted"] = 1
    return {"counts": counts, "seconds": float(found[-1]["seconds"])}


def not_a_pass(counts: dict[str, int]) -> str | None:
    """Why a summary's ``counts`` are not a passing run's (failures, errors, an interrupted
    session, nothing passed); None for a pass."""
    bad = {k: v for k, v in counts.items() if k in ("failed", "error", "errors") and v}
    if bad:
        return str(bad)
    if counts.get("interrupted"):
        return "interrupted"
    return None if counts.get("passed") else "nothing passed"


def render_summary(record: dict[str, Any]) -> list[str]:
    """``summary``: where the suite ran, its minutes and what passed."""
    got, machine = record["figures"], record["machine"]
    minutes, seconds = divmod(round(got["seconds"]), 60)
    return [f"The test suite (what CI runs), a checkout of {record['commit'][:7]}, "
            f"{record['date']}, {machine['cpu']}: **{minutes} min {seconds} s** of pytest on "
            f"two xdist workers, {got['counts']['passed']:,} passed."]


VIEWS = {"summary": render_summary}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.perf.suite", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("log", type=Path, help="what pytest printed")
    args = parser.parse_args()
    seen = provenance(invocation())  # the tree the run starts from
    got = summary(args.log.read_text(errors="replace"))
    if problem := not_a_pass(got["counts"]):
        raise SystemExit(f"bench.perf.suite: {args.log}: the run did not pass ({problem})")
    print(f"record: {write_record(NAME, seen, RENDERER, got)}")


if __name__ == "__main__":
    main()
