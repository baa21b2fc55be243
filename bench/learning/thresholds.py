"""The spread over seeds of the whole InfoNCE and SupCon recipes: per seed, the gain of a
recipe's encoder over the untrained encoder it started from, in weighted kNN top-1 (k = 20)
and linear-probe top-1 of the backbone features; their mean, standard deviation and
mean - 3 sd. The CI learning test's thresholds (``tests/app/test_learning.py``, a few
epochs each) come from ``python -m bench.learning.ci_check`` instead.

    python -m bench.learning --part main --seeds 0 1 2 3 4 --only infonce supcon --no-ceiling
    python -m bench.learning.thresholds --seeds 0 1 2 3 4
    python -m bench.learning.thresholds --out bench/results/learning_avx2 --seeds 0 1 2 3 4

Writes ``thresholds.json`` beside the runs and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path
from typing import Any

from bench.common import write_json
from bench.learning.claims import knn, probe

RECIPES = ("infonce", "supcon")
METRICS = {"kNN top-1": knn, "linear probe": probe}


def result(root: Path, name: str, seed: int) -> dict[str, Any]:
    path = root / "runs" / f"{name}-s{seed}" / "result.json"
    if not path.is_file():
        raise SystemExit(f"{path}: not run (python -m bench.learning --part main --seeds "
                         f"{seed} --only {name} --no-ceiling --out {root})")
    return json.loads(path.read_text())


def gains(root: Path, recipe: str, seeds: list[int]) -> dict[str, list[dict[str, float]]]:
    """metric -> per seed: untrained, trained, gain."""
    out: dict[str, list[dict[str, float]]] = {m: [] for m in METRICS}
    for seed in seeds:
        before, after = result(root, "untrained", seed), result(root, recipe, seed)
        for name, metric in METRICS.items():
            out[name].append({"seed": seed, "untrained": metric(before),
                              "trained": metric(after),
                              "gain": metric(after) - metric(before)})
    return out


def summary(rows: list[dict[str, float]]) -> dict[str, float]:
    values = [r["gain"] for r in rows]
    mean, sd = statistics.fmean(values), statistics.stdev(values)
    return {"mean": mean, "sd": sd, "mean_minus_3sd": mean - 3 * sd,
            "threshold": math.floor(100 * (mean - 3 * sd)) / 100}


def table(report: dict[str, Any]) -> list[str]:
    lines = ["| recipe | measure | per seed: untrained -> trained (gain) | gain mean ± sd "
             "| mean - 3 sd |", "| --- | --- | --- | --- | --- |"]
    for recipe, metrics in report.items():
        for name, entry in metrics.items():
            seeds = ", ".join(f"{r['untrained']:.3f} -> {r['trained']:.3f} ({r['gain']:+.3f})"
                              for r in entry["seeds"])
            s = entry["summary"]
            lines.append(f"| {recipe} | {name} | {seeds} | {s['mean']:.3f} ± {s['sd']:.3f} "
                         f"| {s['mean_minus_3sd']:.3f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.learning.thresholds",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench/results/learning"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    args = parser.parse_args()
    report = {}
    for recipe in RECIPES:
        per_metric = gains(args.out, recipe, args.seeds)
        report[recipe] = {name: {"seeds": rows, "summary": summary(rows)}
                          for name, rows in per_metric.items()}
    write_json(args.out / "thresholds.json", report)
    print("\n".join(table(report)))


if __name__ == "__main__":
    main()
