"""The class each caption set carries (``docs/learning.md``, "The data"): by
all-MiniLM-L6-v2 over the training captions, the mean cosine of two captions of one class
and of two classes, and the class read from a caption by its 20 nearest other captions and
by a logistic regression fitted on 5/6 of them and scored on the rest.

    python -m bench.learning.caption_classes --out DIR            # prints the table
    python -m bench.learning.caption_classes --out DIR --record   # its record

Both caption styles are made in ``DIR`` with the project's own stages, over the same
canvases (``bench/learning/data.py``); a folder made before is reused as it is, so
``--record`` asks for a new one (a record's commit is the code that made its figures).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from bench.learning.data import DataSet, caption_signal, cluttered
from bench.records import invocation, provenance, source_line, write_and_show
from data_pipeline.graph.class_graph import load_class_graph

NAME = "learning/caption_classes"
RENDERER = "bench.learning.caption_classes"  # this module, by the name a record imports it
STYLES = ("attributes", "alt_text")
COLUMNS = (("cosine within a class", "within"), ("between classes", "between"),
           ("gap", "gap"), ("class from the caption: 20-NN", "knn"), ("linear", "linear"))


def caption_figures(data: DataSet) -> dict[str, float]:
    """``data``'s caption signal (within, between, gap) and the class read from a caption
    (knn, linear), as :func:`bench.learning.data.cluttered` left them."""
    accuracy = json.loads((data.caption_graph.parent / "caption_class_accuracy.json")
                          .read_text())
    return {**caption_signal(load_class_graph(data.caption_graph)[0]),
            "knn": accuracy["knn"], "linear": accuracy["linear"]}


def table(sets: dict[str, dict[str, float]]) -> list[str]:
    """One row per caption set."""
    lines = ["| caption set | " + " | ".join(title for title, _ in COLUMNS) + " |",
             "| --- |" + " --- |" * len(COLUMNS)]
    return lines + [f"| {name} | " + " | ".join(f"{figures[key]:.3f}" for _, key in COLUMNS)
                    + " |" for name, figures in sets.items()]


def render_table(record: dict[str, Any]) -> list[str]:
    """``table``: the source, then :func:`table` of the record's caption sets."""
    sets = record["figures"]["caption_sets"]
    return [source_line(record), "", *table({style: sets[style] for style in STYLES})]


VIEWS = {"table": render_table}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True,
                        help="folder of the shards and caption stores (made if missing)")
    parser.add_argument("--train-samples", type=int, default=6000)
    parser.add_argument("--test-samples", type=int, default=1000)
    parser.add_argument("--record", action="store_true",
                        help=f"write the record {NAME} (the benchmark's sample counts only)")
    args = parser.parse_args()
    counts = (args.train_samples, args.test_samples)
    if args.record and counts != (parser.get_default("train_samples"),
                                  parser.get_default("test_samples")):
        parser.error("--record keeps the benchmark's data: leave out the sample counts")
    if args.record and (args.out / "data").exists():
        parser.error(f"--record makes its data anew: {args.out / 'data'} exists (name a new "
                     "--out)")
    seen = provenance(invocation())  # the tree the run starts from
    sets = {style: caption_figures(cluttered(args.out / "data", *counts, style))
            for style in STYLES}
    if args.record:
        write_and_show(NAME, seen, RENDERER, {"caption_sets": sets}, "table")
    else:
        print("\n".join(table(sets)))


if __name__ == "__main__":
    main()
