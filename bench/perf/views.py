"""SimCLR views per image (torchvision's transforms, one call per view) against the batched
views the training loader renders (``data_pipeline/views.py``), on one core.

    python -m bench.perf.views
    python -m bench.perf.views --batch 256 --rounds 5

Both produce the same tensors (``tests/data_pipeline/test_views.py``); the table reports
milliseconds per view and the batched/per-view time ratio for each recipe and size.
``--record`` also writes ``bench/records/perf/views.json`` (view ``summary``).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.common import machine, print_table, time_interleaved, write_json
from bench.records import invocation, provenance, source_line, write_record
from data_pipeline.transforms import simclr_view
from data_pipeline.views import SimCLRViews

RECIPES = {  # name: (recipe, [(decoded image side, view resolution), ...])
    "cluttered self-supervised (hue 0.5, gray 0.5)": (
        {"min_scale": 0.3, "color_strength": 1.0, "grayscale": 0.5, "blur": 0.0, "flip": 0.0,
         "hue": 0.5}, [(40, 32), (256, 224)]),
    "SimCLR CIFAR (s 0.5, blur 0.5)": (
        {"min_scale": 0.08, "color_strength": 0.5, "grayscale": 0.2, "blur": 0.5, "flip": 0.5},
        [(40, 32), (36, 32), (256, 224)]),
}
NAME = "perf/views"
RENDERER = "bench.perf.views"  # this module, by the name a record imports it


def cases(pictures: list[torch.Tensor], resolution: int,
          recipe: dict) -> dict[str, Callable[[], torch.Tensor]]:
    reference = simclr_view(resolution, **recipe)
    batched = SimCLRViews(resolution, **recipe)
    return {"per_view": lambda: torch.stack([reference(p) for p in pictures]),
            "batched": lambda: batched.render([batched.draw(p) for p in pictures])}


def render_summary(record: dict[str, Any]) -> list[str]:
    """The source, and the batched views' time against the per-view transforms' at each
    view resolution (the range over recipes)."""
    by_resolution: dict[int, list[float]] = {}
    for row in record["figures"]["rows"]:
        resolution = int(row["image"].split("-> ")[1].split()[0])
        by_resolution.setdefault(resolution, []).append(row["batched_vs_per_view"])
    spans = [f"{min(r):.2f}-{max(r):.2f}x at {px} px" for px, r in sorted(by_resolution.items())]
    return [f"{source_line(record)} Rendering a batch's SimCLR views at once "
            "(`data_pipeline/views.py`, the same tensors bit for bit), its time against the "
            f"per-view transforms: {', '.join(spans)} (one thread, batches of "
            f"{record['figures']['batch']})."]


VIEWS = {"summary": render_summary}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("bench/results/views.json"))
    parser.add_argument("--record", action="store_true",
                        help=f"also write bench/records/{NAME}.json")
    args = parser.parse_args()
    seen = provenance(invocation())  # the tree the run starts from
    torch.set_num_threads(1)  # a loader worker's share
    gen = torch.Generator().manual_seed(0)
    rows = []
    for name, (recipe, sizes) in RECIPES.items():
        for side, resolution in sizes:
            pictures = [torch.randint(0, 256, (3, side, side), generator=gen,
                                      dtype=torch.uint8) for _ in range(args.batch)]
            times = time_interleaved(cases(pictures, resolution, recipe), args.rounds)
            rows.append({"recipe": name, "image": f"{side} px -> {resolution} px",
                         "per_view_ms": 1000 * times["per_view"] / args.batch,
                         "batched_ms": 1000 * times["batched"] / args.batch,
                         "batched_vs_per_view": times["batched"] / times["per_view"]})
    write_json(args.out, {"machine": machine(), "batch": args.batch, "threads": 1,
                          "rows": rows})
    print(f"SimCLR views, batches of {args.batch}, one thread; ms per view")
    print_table(rows, ["recipe", "image", "per_view_ms", "batched_ms", "batched_vs_per_view"])
    if args.record:
        figures = {"batch": args.batch, "rows": rows}
        print(f"record: {write_record(NAME, seen, RENDERER, figures)}")


if __name__ == "__main__":
    main()
