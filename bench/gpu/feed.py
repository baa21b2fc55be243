"""The kit's parts that ask whether the data path feeds the training step:

- ``feed``: images/s each data backend delivers from shards of JPEGs of ImageNet's mean
  size once its workers have each delivered a batch, two views each at the step's
  resolution (CPU workers at 4, 8 and 16 where the node has the cores;
  ``data.backend=nvjpeg`` with 2 and 4 workers, each JPEG decoder at 4), beside the
  images/s of the project's step for each backbone on synthetic batches already on the
  device. Target on one GPU: nvjpeg with at most 4 workers delivers >= 2x ResNet-50's
  step rate;
- ``e2e``: ``python -m app.pretrain`` under the ImageNet SimCLR recipe trained from shards
  of full-size JPEGs (ImageNet's mean size and 1000 x 750, landscape and portrait) with
  ``data.backend=nvjpeg``, against the same step on synthetic data already on the device.
  Target: >= 0.9x for both models; the run's own ``train/tflops`` and ``train/mfu``
  (``pretrain/loop/utilisation.py``), its non-finite steps and its loss at start and end
  reported.

The JPEGs are ``bench.perf.data_pipeline``'s (digits upsampled with film-grain noise, so they
compress like photographs), written by every core.
"""

from __future__ import annotations

import functools
import math
import os
import re
import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import torch

from bench.gpu.pipeline import REPO, stage
from bench.gpu.sizes import Sizes
from bench.gpu.steps import project_trainer, synchronize, synthetic_batch, timed
from data_pipeline.config import DataConfig
from data_pipeline.dali.jpeg import JPEG_DECODERS
from data_pipeline.loader import train_batches
from pretrain.model.encoder import ModelConfig
from pretrain.objectives import ObjectiveConfig

FEED_TARGET = 2.0  # the device backend's images/s over ResNet-50's step rate
E2E_TARGET = 0.9  # training from shards over the same step on synthetic data
TARGET_WORKERS = 4  # the device backend meets FEED_TARGET with at most this many workers
PROCESSES_FROM = 1000  # JPEGs from which they are written and sharded by every core


Jpegs = tuple[tuple[tuple[int, int], int], ...]  # ((width, height), how many), ...


def jpeg_shards(work: Path, jpegs: Jpegs, name: str) -> tuple[Path, float]:
    """The JPEGs ``jpegs`` lists, written by every core and made into shards under
    ``work``/``name``; the shards' folder and the JPEGs' mean size in KiB."""
    from bench.perf.data_pipeline import write_jpegs
    from data_pipeline.config import ShardsConfig
    from data_pipeline.make_shards import make_shards

    total = sum(count for _, count in jpegs)
    # every core for the GPU's thousands; the dry run's few in this process (a spawned
    # make-shards worker pays seconds of imports)
    cores = (os.cpu_count() or 1) if total >= PROCESSES_FROM else 1
    tree, shards = work / f"jpegs-{name}", work / f"shards-{name}"
    jobs, first = [], 0  # (first index, end, size): each size's indices after the last's
    for size, count in jpegs:
        chunk = math.ceil(count / cores)
        jobs += [(first + start, first + min(count, start + chunk), size)
                 for start in range(0, count, chunk)]
        first += count
    if cores == 1:
        for start, end, size in jobs:
            write_jpegs(tree, end, size, start)
    else:
        with ProcessPoolExecutor(cores) as pool:
            for written in [pool.submit(write_jpegs, tree, end, size, start)
                            for start, end, size in jobs]:
                written.result()
    files = list(tree.rglob("*.JPEG"))
    kib = sum(f.stat().st_size for f in files) / len(files) / 1024
    make_shards(ShardsConfig(source="imagenet", input=str(tree), output=str(shards),
                             shard_size=max(1, math.ceil(total / (2 * cores))), workers=cores))
    return shards, kib


def both_orientations(size: tuple[int, int], count: int) -> Jpegs:
    """``count`` JPEGs, half of ``size`` (width, height), half turned (portrait)."""
    return ((size, count - count // 2), ((size[1], size[0]), count // 2))


def model_config(backbone: str, resolution: int) -> ModelConfig:
    return ModelConfig(backbone=backbone, small_stem=False, image_size=resolution)


def synthetic_rate(backbone: str, sizes: Sizes, device: torch.device, work: Path
                   ) -> tuple[float, str]:
    """Images/s (two views each) of the project's step on a synthetic batch on ``device``,
    and the precision it ran in."""
    batch = synthetic_batch(sizes.step_images, sizes.step_resolution, device)
    with tempfile.TemporaryDirectory(dir=work) as run_dir:
        trainer = project_trainer(model_config(backbone, sizes.step_resolution),
                                  ObjectiveConfig(name="infonce"), sizes.step_images, device,
                                  Path(run_dir))
        _, seconds = timed(functools.partial(trainer.train_step, batch), sizes.step_steps,
                           device)
        precision = trainer.precision
        del trainer
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return sizes.step_images / seconds, precision


def steady_rate(shards: Path, sizes: Sizes, workers: int, backend: str, decoder: str,
                device: torch.device) -> float:
    """Images/s (two views each) one loader delivers once every worker has delivered a
    batch (started, imports done, the decoder set up, the page cache warm), to the epoch's
    end."""
    cfg = DataConfig(shards=str(shards), batch_size=sizes.step_images, workers=workers,
                     resolution=sizes.step_resolution, augment="simclr", crop_min_scale=0.08,
                     backend=backend, decoder=decoder or "auto")
    warm, images, start = workers + 1, 0, 0.0
    for index, batch in enumerate(train_batches(cfg, device=device)):
        if index == warm:
            synchronize(device)
            start = time.perf_counter()
        elif index > warm:
            images += batch["images"].shape[0] // 2
    synchronize(device)
    if not images:
        raise ValueError(f"feed: {sizes.feed_images} JPEGs leave no batch after the "
                         f"{warm + 1} uncounted ones: raise feed_images")
    return images / (time.perf_counter() - start)


def feed(sizes: Sizes, device: torch.device, work: Path, deadline: float, rows: list,
         **_: Any) -> dict[str, Any]:
    """Each backend's images/s against each backbone's step rate."""
    size = sizes.e2e_jpeg_sizes[0]
    shards, kib = jpeg_shards(work, ((size, sizes.feed_images),), "feed")
    steps = {backbone: synthetic_rate(backbone, sizes, device, work)[0]
             for backbone in sizes.step_backbones}
    rows.extend({"source": f"step: {backbone}", "images_s": rate}
                for backbone, rate in steps.items())
    cores = os.cpu_count() or 1
    first = sizes.step_backbones[0]
    for backend, workers, decoder in sizes.feed_cases:
        case = {"source": backend, "workers": workers, "decoder": decoder}
        if workers > cores or time.monotonic() > deadline:
            rows.append({**case, "note": f"{cores} cores" if workers > cores
                         else "past the deadline"})
            continue
        if decoder and not JPEG_DECODERS[decoder].available():
            rows.append({**case, "note": "not installed"})
            continue
        rate = steady_rate(shards, sizes, workers, backend, decoder, device)
        row = {**case, "jpeg_kib": kib, "images_s": rate,
               **{f"x_{i}": rate / steps[b] for i, b in enumerate(sizes.step_backbones)}}
        if backend != "cpu" and workers <= TARGET_WORKERS:
            row["target"] = "met" if rate >= FEED_TARGET * steps[first] else "not met"
        rows.append(row)
        print(f"  {backend} {decoder} x{workers}: {rate:.0f} images/s", flush=True)
    device_rows = [r for r in rows if "target" in r]
    return {"rows": rows, "ok": all("images_s" in r or "note" in r for r in rows),
            "summary": f"x_0, x_1: images/s over the step rate of {', '.join(steps)}; "
                       f"target >= {FEED_TARGET:g}x {first} with <= {TARGET_WORKERS} workers: "
                       + ("met" if any(r["target"] == "met" for r in device_rows)
                          else "not met")}


def window_rates(log: str) -> list[dict[str, float]]:
    """Each metric row an ``app.pretrain`` run logged: images_per_s (views), tflops, mfu."""
    rows = []
    for line in re.findall(r"step \d+ (.*)", log):
        row = dict(re.findall(r"([\w./]+)=([-\d.e+]+|nan|inf)", line))
        if "images_per_s" in row:
            rows.append({k: float(v) for k, v in row.items()})
    return rows


def pretrain_from_shards(shards: Path, backbone: str, sizes: Sizes, work: Path,
                         deadline: float) -> list[dict]:
    """One process of ``app.pretrain`` under the ImageNet SimCLR recipe (its augmentation)
    for ``e2e_steps`` steps (one epoch of ``shards``): its metric rows."""
    name = f"{backbone.replace(':', '-')}-{shards.name}"
    config = ["--config", str(REPO / "launch/configs/imagenet_simclr.yaml"), f"name={name}",
              "tracking.enabled=false", f"data.shards={shards}",
              f"data.batch_size={sizes.step_images}", f"data.workers={sizes.e2e_workers}",
              "data.backend=nvjpeg", f"data.resolution={sizes.step_resolution}",
              f"model.backbone={backbone}", f"model.image_size={sizes.step_resolution}",
              "model.width=64", "optim.warmup_steps=2", "train.epochs=1",
              f"train.log_every={sizes.e2e_window}", "train.progress=false",
              "checkpoint.every=0"]
    log = work / f"{name}.log"
    return window_rates(stage(config, log, "app.pretrain", deadline))


def e2e(sizes: Sizes, device: torch.device, work: Path, deadline: float, rows: list,
        **_: Any) -> dict[str, Any]:
    """Each model trained from JPEGs of each size, landscape and portrait, against its
    synthetic step rate; the run's non-finite steps and its loss at start and end."""
    images = sizes.e2e_steps * sizes.step_images  # one epoch: no worker restarts inside
    synthetic_rates = {b: synthetic_rate(b, sizes, device, work) for b in sizes.e2e_backbones}
    for size in sizes.e2e_jpeg_sizes:
        shards, kib = jpeg_shards(work, both_orientations(size, images),
                                  f"{size[0]}x{size[1]}")
        for backbone, (synthetic, precision) in synthetic_rates.items():
            windows = pretrain_from_shards(shards, backbone, sizes, work, deadline)
            steady = windows[1:] or windows  # the first window holds start-up
            rate = statistics.median(w["images_per_s"] for w in steady) / 2  # views -> images
            mfu = [w["train/mfu"] for w in steady if "train/mfu" in w]
            rows.append({"model": backbone, "jpeg": f"{size[0]}x{size[1]} both ways",
                         "jpeg_kib": kib, "precision": precision, "workers": sizes.e2e_workers,
                         "images_s": rate, "synthetic_images_s": synthetic,
                         "vs_synthetic": rate / synthetic,
                         "tflops": statistics.median(w["train/tflops"] for w in steady),
                         "mfu": statistics.median(mfu) if mfu else None,
                         "nonfinite_steps": windows[-1].get("nonfinite_steps"),
                         "first_loss": windows[0].get("loss"),
                         "last_loss": windows[-1].get("loss"),
                         "target": "met" if rate >= E2E_TARGET * synthetic else "not met"})
            print(f"  {backbone} from {size}: {rate:.0f} images/s, synthetic {synthetic:.0f}",
                  flush=True)
    finite = all(row["nonfinite_steps"] == 0 for row in rows)
    return {"rows": rows, "ok": bool(rows) and finite,
            "summary": f"data.backend=nvjpeg, ImageNet SimCLR views, {sizes.e2e_workers} "
                       f"workers; non-finite steps: {'none' if finite else 'SOME'}; target >= "
                       f"{E2E_TARGET:g}x synthetic: "
                       f"{sum(r['target'] == 'met' for r in rows)}/{len(rows)} met"}
