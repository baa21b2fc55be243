"""The README's demo figures as a record: what ``bash launch/demo.sh`` evaluated.

    bash launch/demo.sh && .venv/bin/python -m bench.learning.demo_record   # where it ran

Reads the demo's ``runs/cluttered-xclr-demo/eval/results.json`` (kNN at k = 20 and the
linear probe of the backbone, each beside the untrained encoder) and writes
``bench/records/learning/demo.json`` with the checkout's commit; its view ``summary`` is the
README's sentence.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from bench.records import REPO, invocation, provenance, write_record

NAME = "learning/demo"
RENDERER = "bench.learning.demo_record"  # this module, by the name a record imports it
RESULTS = Path("runs/cluttered-xclr-demo/eval/results.json")  # under the demo's directory
K = "k20"


def figures(results: dict[str, Any]) -> dict[str, float]:
    """The backbone's kNN top-1 at k = 20 and probe top-1, trained and untrained."""
    return {"knn": results["knn"]["backbone"][K]["top1"],
            "knn_untrained": results["untrained"]["knn"]["backbone"][K]["top1"],
            "probe": results["linear_probe"]["top1"],
            "probe_untrained": results["untrained"]["linear_probe"]["top1"]}


def render_summary(record: dict[str, Any]) -> list[str]:
    """``summary``: where the demo ran, and its kNN and probe beside the untrained
    encoder's."""
    got, machine = record["figures"], record["machine"]
    return [f"From a checkout of {record['commit'][:7]} ({machine['cpu']}, {machine['cores']} "
            f"threads, {record['date']}): backbone kNN top-1 {got['knn']:.3f} at k = 20 "
            f"(untrained {got['knn_untrained']:.3f}), linear probe {got['probe']:.3f} "
            f"(untrained {got['probe_untrained']:.3f})."]


VIEWS = {"summary": render_summary}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.learning.demo_record",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("demo_dir", type=Path, nargs="?", default=REPO,
                        help="where the demo ran (its DEMO_DIR; default this checkout)")
    args = parser.parse_args()
    seen = provenance(invocation())  # the tree the run starts from
    results = json.loads((args.demo_dir / RESULTS).read_text())
    print(f"record: {write_record(NAME, seen, RENDERER, figures(results))}")


if __name__ == "__main__":
    main()
