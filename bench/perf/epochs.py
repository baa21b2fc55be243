"""Epoch boundaries of the training loader: a DataLoader made per epoch against one whose
workers persist (``data.persistent_workers``).

    python -m bench.perf.epochs                     # cluttered digits, 32 px, 4 epochs
    python -m bench.perf.epochs --step-ms 300 --epochs 6

The consumer stands for an accelerator's training step: it sleeps ``--step-ms`` per batch,
leaving the host's cores to the loader as a GPU step does. Reported per loader: the
wall time of the epochs, the wait for the first batch of each epoch after the first (the
stall a trainer sees at the boundary), and the mean wait for the other batches. Both
loaders run in the same process, interleaved, and deliver the same batches. ``--record``
also writes ``bench/records/perf/epochs.json`` (view ``summary``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from bench.common import machine, print_table, write_json
from bench.records import invocation, provenance, source_line, write_record
from data_pipeline.config import DataConfig, ShardsConfig
from data_pipeline.loader import LoaderState, TrainLoader
from data_pipeline.make_shards import make_shards

NAME = "perf/epochs"
RENDERER = "bench.perf.epochs"  # this module, by the name a record imports it


def timed_epochs(cfg: DataConfig, epochs: int, step_s: float) -> dict[str, float]:
    loader = TrainLoader(cfg, state=LoaderState())
    first, other = [], []
    start = time.perf_counter()
    for epoch in tqdm(range(epochs), desc=f"persistent={cfg.persistent_workers}",
                      unit="epoch", leave=False):
        asked = time.perf_counter()
        for i, _batch in enumerate(loader.epoch()):
            waited = time.perf_counter() - asked
            if i == 0 and epoch > 0:
                first.append(waited)
            elif i > 0:
                other.append(waited)
            time.sleep(step_s)
            asked = time.perf_counter()
    seconds = time.perf_counter() - start
    loader.close()
    return {"seconds": seconds, "boundary_wait_s": statistics.mean(first),
            "batch_wait_ms": 1000 * statistics.mean(other)}


def render_summary(record: dict[str, Any]) -> list[str]:
    """The source, and the wait for an epoch's first batch with and without persistent
    workers."""
    got = record["figures"]
    per_epoch, persistent = got["rows"]
    verb = "cut" if persistent["boundary_wait_s"] < per_epoch["boundary_wait_s"] else "raise"
    return [f"{source_line(record)} Persistent workers {verb} the wait for an epoch's first "
            f"batch from {per_epoch['boundary_wait_s']:.3f} s to "
            f"**{persistent['boundary_wait_s']:.3f} s** ({got['samples']:,} canvases, "
            f"{got['epochs']} epochs, {got['step_ms']:.0f} ms steps)."]


VIEWS = {"summary": render_summary}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=6000)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--step-ms", type=float, default=100.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--workdir", type=Path, default=Path("bench/results/epochs"))
    parser.add_argument("--out", type=Path, default=Path("bench/results/epochs.json"))
    parser.add_argument("--record", action="store_true",
                        help=f"also write bench/records/{NAME}.json")
    args = parser.parse_args()
    seen = provenance(invocation())  # the tree the run starts from
    workers = os.cpu_count() or 1
    shards = args.workdir / f"cluttered-{args.samples}"
    make_shards(ShardsConfig(source="cluttered_digits", split="train", samples=args.samples,
                             output=str(shards), shard_size=1000, workers=workers))
    base = DataConfig(shards=str(shards), batch_size=args.batch, workers=workers,
                      resolution=32, crop_min_scale=0.3, blur=0.0, flip=0.0)
    rounds: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    for _ in range(args.rounds):
        for persistent in rounds:
            cfg = DataConfig(**{**vars(base), "persistent_workers": persistent})
            rounds[persistent].append(timed_epochs(cfg, args.epochs, args.step_ms / 1000))
    median = {p: {k: statistics.median(r[k] for r in runs) for k in runs[0]}
              for p, runs in rounds.items()}
    rows = [{"loader": "a DataLoader per epoch" if not p else "persistent workers",
             **median[p], "time_vs_per_epoch": median[p]["seconds"] / median[False]["seconds"]}
            for p in (False, True)]
    figures = {"workers": workers, "samples": args.samples, "batch": args.batch,
               "epochs": args.epochs, "step_ms": args.step_ms, "rows": rows}
    write_json(args.out, {"machine": machine(), **figures,
                          "rounds": {str(k): v for k, v in rounds.items()}})
    if args.record:
        print(f"record: {write_record(NAME, seen, RENDERER, figures)}")
    print(f"{args.epochs} epochs of {args.samples // args.batch} batches of {args.batch}, "
          f"{workers} workers, a {args.step_ms:.0f} ms step per batch")
    print_table(rows, ["loader", "seconds", "boundary_wait_s", "batch_wait_ms",
                       "time_vs_per_epoch"])


if __name__ == "__main__":
    main()
