"""The record behind the CI learning test's thresholds (``tests/app/test_learning.py``,
``docs/learning.md``, "What CI asserts"): the gain of each checked recipe over seeds, as
``bench.learning.ci_check`` measured it.

    python -m bench.learning.ci_check --recipe infonce --epochs 2      # and the others of CHECKS
    python -m bench.learning.ci_record                                 # then gather them

Reads the report ``ci_check`` writes for each of :data:`CHECKS` (under ``--out``, its own
default) and writes ``bench/records/learning/ci_check.json``; each check keeps its report's
provenance (command, commit, date, machine). A check not run stops the gathering, naming
the command that runs it. Each seed's run keeps its own commit too (``runs``): a report
made again from runs already made reads them, it does not train them again.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from bench.learning.ci_check import MEASURES, REPO, run_name
from bench.records import invocation, provenance, write_and_show

NAME = "learning/ci_check"
RENDERER = "bench.learning.ci_record"  # this module, by the name a record imports it
# (recipe, caption set, epochs): the checks the CI learning test runs
CHECKS = (("infonce", "attributes", 2), ("supcon", "attributes", 2),
          ("xclr_captions", "alt_text", 2), ("clip", "attributes", 1))
WORDS = {"knn": "kNN top-1", "probe": "linear probe", "views": "view retrieval",
         "captions": "caption retrieval R@1"}


def check_figures(report: dict[str, Any]) -> dict[str, Any]:
    """One check's gains per seed and their summary, per measure it has, with the
    provenance of the run that measured them."""
    measures = {}
    for name in MEASURES:
        if name not in report["summary"]:
            continue
        gains = {seed: r["trained"][name] - r["untrained"][name]
                 for seed, r in report["per_seed"].items()}
        measures[name] = {"gains": gains, **report["summary"][name]}
    seen = report["provenance"]
    runs = [{"seed": seed, "commit": (r.get("provenance") or {}).get("commit")}
            for seed, r in report["per_seed"].items()]  # each seed's run, where it says
    return {"recipe": report["recipe"], "captions": report["captions"],
            "epochs": report["epochs"], "measures": measures, "runs": runs,
            "command": seen["command"],
            "commit": seen["commit"], "dirty": seen["dirty"], "date": seen["date"],
            "cpu": seen["machine"]["cpu"], "kernels": report.get("cpu_capability")}


def gather(out: Path) -> list[dict[str, Any]]:
    checks = []
    for recipe, captions, epochs in CHECKS:
        path = out / f"ci_check-{run_name(recipe, captions, epochs, [])}.json"
        if not path.is_file():
            raise SystemExit(f"{path}: not run (python -m bench.learning.ci_check --recipe "
                             f"{recipe} --captions {captions} --epochs {epochs})")
        checks.append(check_figures(json.loads(path.read_text())))
    return checks


def render_table(record: dict[str, Any]) -> list[str]:
    """Each check's commands and sources, then per measure the gain per seed, mean ± sd and
    mean - 3 sd."""
    checks = record["figures"]["checks"]
    sources = sorted({f"{c['cpu']} ({c['kernels']} kernels), trained at "
                      f"{', '.join(sorted({r['commit'][:7] for r in c['runs'] if r['commit']}))}"
                      f", summarised at {c['commit'][:7]}"
                      f"{' with changes' if c['dirty'] else ''}, {c['date']}" for c in checks})
    lines = ["```bash", *(c["command"] for c in checks), "```", "",
             f"Measured on {'; '.join(sources)}:", "",
             "| recipe | measure | gain per seed | mean ± sd | mean - 3 sd |",
             "| --- | --- | --- | --- | --- |"]
    for check in checks:
        what = (f"{check['recipe']}{', alt-text' if check['captions'] == 'alt_text' else ''}, "
                f"{check['epochs']} epoch{'s' if check['epochs'] > 1 else ''}")
        for name, got in check["measures"].items():
            gains = ", ".join(f"{g:+.3f}" for g in got["gains"].values())
            lines.append(f"| {what} | {WORDS[name]} | {gains} | {got['mean']:.3f} ± "
                         f"{got['sd']:.3f} | {got['mean_minus_3sd']:.4f} |")
    return lines


VIEWS = {"table": render_table}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "ci_check",
                        help="where ci_check wrote its reports")
    args = parser.parse_args()
    seen = provenance(invocation())  # the tree the gathering starts from
    write_and_show(NAME, seen, RENDERER, {"checks": gather(args.out)}, "table")


if __name__ == "__main__":
    main()
