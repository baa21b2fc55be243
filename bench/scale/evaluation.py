"""Evaluation at ImageNet's cardinality (``python -m bench.scale --part evaluation``): a
bank of synthetic features (1,000 Gaussian classes, 512-d, up to ImageNet's 1,281,167
rows) and 50,000 queries, each stage in its own process so that its peak resident memory
is its own:

- ``knn``: exact search of the bank in blocks (``faiss_flat``: faiss's brute-force ``knn``
  per block) and the weighted kNN votes of every query, k up to 200;
- ``margin``: SINCERE's target-noise margin of every query against the bank;
- ``probe``: one epoch of the linear probe over the bank (the default runs 100; its cost
  is linear in them), then top-1 on the queries;
- ``diagnostics``: class geometry of the queries, alignment/uniformity and the kNN mutual
  information on their 10,000-sample subsample.

``evaluate-run``: the real ``evaluate`` on 2 ranks (torchrun, gloo) of a small CNN (width
64) over up to 300,000 real 16 px JPEGs of 1,000 classes (``make-shards`` of a
class-sorted tree) and 10,000 test images, twice into the same run: the largest rank's
peak memory against the bank's size, and the run folder's growth by the second evaluation.

Peak memory is reported beside the features' own size (bank and queries) and as what the
stage added to the process once the features were made: that is what ``eval.block_mib``
bounds.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import peak_rss_bytes, rss_bytes
from bench.processes import run_command
from bench.scale.ingest import SHARD, image_tree
from evaluation.diagnostics import (
    alignment_uniformity,
    class_geometry,
    knn_mutual_information,
    target_noise_margin,
)
from evaluation.knn import build_index, knn_accuracy
from evaluation.probe import linear_probe

CLASSES, DIM, QUERIES = 1_000, 512, 50_000
KS = [1, 5, 10, 20, 50, 100, 200]
BLOCK_BYTES = 256 * 2**20  # eval.block_mib's default
STAGES = ("knn", "margin", "probe", "diagnostics")


def features(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[rows, DIM] float32 features of CLASSES Gaussian classes and their [rows] labels,
    made in place block by block (no second copy)."""
    gen = torch.Generator().manual_seed(0)
    centres = torch.randn(CLASSES, DIM, generator=gen)
    gen.manual_seed(seed)
    labels = torch.randint(0, CLASSES, (rows,), generator=gen)
    out = torch.empty(rows, DIM)
    for start in range(0, rows, 65536):
        block = out[start:start + 65536]
        block.normal_(generator=gen).mul_(2.0).add_(centres[labels[start:start + 65536]])
    return out, labels


def run_stage(stage: str, rows: int) -> dict[str, Any]:
    """One stage over a bank of ``rows`` rows and QUERIES queries: seconds, peak RSS."""
    bank, bank_labels = features(rows, seed=1)
    queries, query_labels = features(QUERIES, seed=2)
    features_mib = (bank.nbytes + queries.nbytes) / 2**20
    before = rss_bytes() / 2**20  # the features and the imported libraries
    start = time.perf_counter()
    if stage == "knn":
        index = build_index(bank, "faiss_flat", block_bytes=BLOCK_BYTES)
        accuracy, _ = knn_accuracy(index, bank_labels, queries, query_labels, KS, 0.07,
                                   CLASSES, BLOCK_BYTES)
        value = accuracy["k20"]["top1"]
    elif stage == "margin":
        value = target_noise_margin(bank, bank_labels, queries, query_labels,
                                    BLOCK_BYTES)["margin"]
    elif stage == "probe":
        value = linear_probe(bank, bank_labels, queries, query_labels, CLASSES, epochs=1,
                             lr=0.1)["top1"]
    else:
        class_geometry(queries, query_labels)
        alignment_uniformity(queries, query_labels, 10_000, block_bytes=BLOCK_BYTES)
        value = knn_mutual_information(queries, query_labels, 3, 10_000,
                                       block_bytes=BLOCK_BYTES)
    seconds = time.perf_counter() - start
    peak = peak_rss_bytes() / 2**20
    return {"stage": stage, "rows": rows, "queries": QUERIES, "seconds": round(seconds, 1),
            "peak_rss_mib": round(peak), "features_mib": round(features_mib),
            "stage_added_mib": round(peak - before), "value": round(float(value), 4)}


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def run_evaluate(images: int, workdir: Path, probe_epochs: int) -> dict[str, Any]:
    """``evaluate`` on 2 ranks over ``images`` real 16 px JPEGs of 1,000 classes (bank) and
    a 10,000-image test set, twice into one run: peak memory per rank against the bank's
    size, and how much the second evaluation adds to the run's folder."""
    shards = {}
    for name, count in (("bank", images), ("test", 10_000)):
        shards[name] = workdir / f"eval-shards-{name}-{count}"
        if not (shards[name] / "manifest.json").is_file():
            run_command("app.make_shards", [
                "shards.source=imagenet", f"shards.input={image_tree(workdir, count)}",
                f"shards.output={shards[name]}", f"shards.shard_size={SHARD}",
                "shards.workers=2"])
    runs = workdir / f"eval-runs-{images}"
    shutil.rmtree(runs, ignore_errors=True)
    common = [f"output_dir={runs}", "name=evalscale", "model.width=64", "data.resolution=16",
              "data.workers=1", f"data.shards={shards['test']}", "train.max_steps=1",
              "train.progress=false", "checkpoint.every=1"]
    run_command("app.pretrain", [*common, "data.batch_size=32"])  # one step: a checkpoint
    before = folder_bytes(runs / "evalscale")
    evaluate = [*common, f"eval.train_shards={shards['bank']}",
                f"eval.test_shards={shards['test']}", f"eval.probe_epochs={probe_epochs}"]
    first = run_command("app.evaluate", evaluate, nproc=2)
    after_first = folder_bytes(runs / "evalscale")
    second = run_command("app.evaluate", evaluate, nproc=2)
    after_second = folder_bytes(runs / "evalscale")
    bank_mib = images * (4 * 64 + 128) * 4 / 2**20  # small_cnn width 64: 4w backbone + 128
    return {"images": images, "bank_mib": round(bank_mib),
            "first_s": round(first["seconds"], 1), "first_rss_mib": round(first["worker_rss_mib"]),
            "second_s": round(second["seconds"], 1),
            "second_rss_mib": round(second["worker_rss_mib"]),
            "run_mib_after_first": round((after_first - before) / 2**20, 1),
            "second_adds_mib": round((after_second - after_first) / 2**20, 1),
            "growth": round((after_second - before) / max(1, after_first - before), 3)}
