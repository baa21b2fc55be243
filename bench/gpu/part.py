"""One part of the GPU kit, in a process of its own: ``python -m bench.gpu`` forks it from a
server that imported this module (:func:`logged`); by hand,

    python -m bench.gpu.part NAME WORK_DIR --seconds S [--dry-run]

writes ``WORK_DIR/NAME.json``: ``{"rows": [...], "ok": bool, "summary": str}``, rewritten
with the rows so far (``"partial": true``) as each row is made (:class:`Rows`), so a part
killed mid-way keeps what it measured. The parts are the entries of :data:`PARTS`, each
with its share of the kit's time budget and the columns of its table.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench.gpu import feed, losses, pipeline, sharded, steps, views
from bench.gpu.sizes import DRY_RUN, GPU


class Rows(list):
    """A part's rows: each one appended is written to ``path`` at once, with the rows before
    it, as a partial result."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path

    def append(self, row: dict[str, Any]) -> None:
        super().append(row)
        write_atomically(self.path, json.dumps(
            {"rows": list(self), "ok": False, "partial": True,
             "summary": "partial: the part did not finish"}, indent=2))

    def extend(self, rows: Any) -> None:
        for row in rows:
            self.append(row)


def write_atomically(path: Path, text: str) -> None:
    """``path`` holds ``text``, or what it held before: never half of it (a part or the
    kit killed, or a reader, mid-write)."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    os.replace(partial, path)


@dataclass(frozen=True)
class Part:
    # (sizes, device, work, deadline, dry_run, rows) -> result; rows: where it appends
    run: Callable[..., dict[str, Any]]
    share: float  # of the kit's time budget
    title: str
    columns: tuple[str, ...]


PARTS: dict[str, Part] = {
    "tests": Part(pipeline.tests, 0.16, "CUDA-gated and CUDA dry-run tests",
                  ("tests", "failed", "skipped", "seconds", "cuda", "failures")),
    "sync": Part(steps.sync, 0.10, "Host synchronisations per training step",
                 ("objective", "variant", "steps", "synchronisations", "where")),
    "objectives": Part(losses.objectives, 0.25, "Objectives: forward + backward",
                       ("N", "tile", "loss", "fwd_bwd_ms", "peak_mib", "note")),
    "step": Part(steps.step, 0.10, "Training step, bf16, channels-last",
                 ("backbone", "precision", "views", "images_s", "plain_images_s",
                  "vs_plain", "tflops", "plain_tflops", "mfu")),
    "feed": Part(feed.feed, 0.08, "Data backends against the step rate (images/s, two views "
                 "each)", ("source", "workers", "decoder", "jpeg_kib", "images_s", "x_0",
                           "x_1", "target", "note")),
    "e2e": Part(feed.e2e, 0.20, "Training from JPEG shards against synthetic batches",
                ("model", "jpeg", "jpeg_kib", "precision", "workers", "images_s",
                 "synthetic_images_s", "vs_synthetic", "tflops", "mfu", "nonfinite_steps",
                 "first_loss", "last_loss", "target")),
    "views": Part(views.views, 0.20, "Device views against the CPU path's (same keys and "
                  "parameters), a training step beside", ("decoder", "batches", "images",
                                                         "keys_differ", "nonfinite", "corrupt",
                                                         "mean_diff_levels",
                                                         "worst_batch_levels",
                                                         "pressure_steps", "seconds", "ok",
                                                         "note")),
    "demo": Part(pipeline.demo, 0.13, "Demo pipeline, one process, DDP, no MLflow",
                 ("ranks", "device", "precision", "backend", "steps", "train_s", "images_s",
                  "knn_top1")),
    "fsdp2": Part(pipeline.fsdp2, 0.10, "engine.name=fsdp2, one process, then resumed under DDP",
                  ("model", "precision", "backend", "steps", "train_s", "resumed",
                   "first_loss", "last_loss", "knn_top1")),
    "sharded": Part(sharded.sharded, 0.10, "engine.name=fsdp2 steps: host synchronisations, "
                    "ViT-L recipes", ("case", "checkpointing", "synchronisations", "where",
                                      "views", "images_s", "step_s", "first_step_s",
                                      "peak_gib")),
    "compile": Part(steps.compiled, 0.08, "train.compile",
                    ("backbone", "compiled", "backend", "first_step_s", "step_s", "vs_eager")),
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name", choices=list(PARTS))
    parser.add_argument("work", type=Path)
    parser.add_argument("--seconds", type=float, required=True, help="this part's budget")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes")
    args = parser.parse_args(argv)
    deadline = time.monotonic() + args.seconds
    device = torch.device("cpu" if args.dry_run else "cuda")
    work = args.work / args.name
    work.mkdir(parents=True, exist_ok=True)
    out = args.work / f"{args.name}.json"
    result = PARTS[args.name].run(sizes=DRY_RUN if args.dry_run else GPU, device=device,
                                  work=work, deadline=deadline, dry_run=args.dry_run,
                                  rows=Rows(out))
    write_atomically(out, json.dumps(result, indent=2))


def logged(argv: list[str], log: str) -> None:
    """:func:`main` with ``argv``, its output (and any child process's) into ``log``: the
    body of a part forked by ``python -m bench.gpu``."""
    with open(log, "w") as sink:
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)
    # a forked child inherits the server's start method; the part's own processes (loader
    # workers) start as they would from a fresh interpreter (a spawned worker pays seconds)
    multiprocessing.set_start_method(None, force=True)
    try:
        main(argv)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


if __name__ == "__main__":
    main()
