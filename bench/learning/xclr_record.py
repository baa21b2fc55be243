"""The record of X-CLR on the alt-text captions (``docs/learning.md``, "X-CLR on web
captions"): each lever's runs and CLIP with its own text tower, per seed, against the
untrained encoder of the same seed.

    python -m bench.learning.xclr_record --out bench/results/learning   # the runs' folder

Reads ``<out>/runs/<name>-s<seed>/result.json`` as ``python -m bench.learning`` left them
and writes ``bench/records/learning/xclr_levers.json``; a run missing is left out and
named. Each run keeps the provenance its result holds (commit, date, machine), or None
where the run predates provenance in results.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from bench.learning.benchmark_tables import mean_sd
from bench.records import invocation, provenance, write_and_show

NAME = "learning/xclr_levers"
RENDERER = "bench.learning.xclr_record"  # this module, by the name a record imports it
SEEDS = (0, 1, 2)
# configuration -> the row's words (one change from the previous recipe each, then two,
# then the paper's comparison)
ROWS = {
    "sweep_alt_xclr_tau_s0.1": "previous recipe: tau_s 0.1, plain store, 128 images a step, "
                               "30 epochs",
    "sweep_alt_xclr_tau_s0.05": "tau_s 0.05 (the recipe)",
    "sweep_alt_xclr_centred": "centred store (`graph.center=true`)",
    "sweep_alt_xclr_top_k16": "`top_k=16`",
    "sweep_alt_xclr_batch128": "256 images a step (half the steps)",
    "sweep_alt_xclr_epochs60": "60 epochs",
    "sweep_alt_xclr_tau_s0.05_centred": "tau_s 0.05, centred store",
    "alt_clip_scratch": "CLIP, text tower from scratch",
}


def knn_top1(result: dict[str, Any]) -> float:
    return result["evaluation"]["knn"]["backbone"]["k20"]["top1"]


def run_figures(result: dict[str, Any], floor: dict[str, Any]) -> dict[str, Any]:
    evaluation = result["evaluation"]
    zero_shot = evaluation.get("zero_shot") or {}
    seen = result.get("provenance") or {}
    return {"knn": knn_top1(result), "floor": knn_top1(floor),
            "probe": evaluation["linear_probe"]["top1"],
            "zero_shot": zero_shot.get("accuracy", {}).get("top1"),
            "commit": seen.get("commit"), "date": seen.get("date"),
            "cpu": seen.get("machine", {}).get("cpu")}


def collect(root: Path) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """{configuration: {seed: figures}} of the finished runs, and the runs missing."""
    def result(name: str) -> dict[str, Any] | None:
        path = root / "runs" / name / "result.json"
        return json.loads(path.read_text()) if path.is_file() else None

    figures: dict[str, dict[str, Any]] = {}
    missing = []
    for conf in ROWS:
        for seed in SEEDS:
            run, floor = result(f"{conf}-s{seed}"), result(f"untrained-s{seed}")
            if run is None or floor is None:
                missing.append(f"{conf}-s{seed}")
                continue
            figures.setdefault(conf, {})[str(seed)] = run_figures(run, floor)
    return figures, missing


def render_levers(record: dict[str, Any]) -> list[str]:
    """``levers``: each configuration's kNN per seed, gain and probe (mean ± sd)."""
    lines = ["| configuration | seeds | kNN per seed | gain | linear probe |",
             "| --- | --- | --- | --- | --- |"]
    for conf, words in ROWS.items():
        runs = record["figures"]["runs"].get(conf)
        if not runs:
            continue
        seeds = sorted(runs, key=int)
        knn = [runs[s]["knn"] for s in seeds]
        gain = [100 * (runs[s]["knn"] - runs[s]["floor"]) for s in seeds]
        probe = [runs[s]["probe"] for s in seeds]
        lines.append(f"| {words} | {', '.join(seeds)} | {', '.join(f'{k:.3f}' for k in knn)} "
                     f"| {mean_sd(gain, 1, '+')} | {mean_sd(probe, 3)} |")
    return lines


VIEWS = {"levers": render_levers}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results/learning"))
    args = parser.parse_args()
    seen = provenance(invocation())  # the tree the run starts from
    runs, missing = collect(args.out)
    for name in missing:
        print(f"not run: {name}")
    write_and_show(NAME, seen, RENDERER, {"runs": runs}, "levers")


if __name__ == "__main__":
    main()
