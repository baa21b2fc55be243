"""The kit's parts that ask whether the data path feeds the training step:

- ``feed``: images/s each data backend delivers from shards of JPEGs of ImageNet's mean
  size, two views each at the step's resolution (CPU workers at 4, 8 and 16 where the node
  has the cores; ``data.backend=nvjpeg`` with 2 and 4 workers), beside the images/s of the
  project's step for each backbone on synthetic batches already on the device. Target on
  one GPU: nvjpeg with at most 4 workers delivers >= 2x ResNet-50's step rate;
- ``e2e``: ``python -m app.pretrain`` trained from shards of full-size JPEGs (ImageNet's
  mean size and 1000 x 750) with ``data.backend=nvjpeg``, against the same step on
  synthetic data already on the device. Target: >= 0.9x for both models; the run's own
  ``train/tflops`` and ``train/mfu`` (``pretrain/loop/utilisation.py``) reported.

The JPEGs are ``bench.data_pipeline``'s (digits upsampled with film-grain noise, so they
compress like photographs), written by every core.
"""

from __future__ import annotations

import functools
import math
import os
import re
import statistics
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import torch

from bench.gpu.pipeline import REPO, stage
from bench.gpu.sizes import Sizes
from bench.gpu.steps import project_trainer, synthetic_batch, timed
from pretrain.losses import ObjectiveConfig
from pretrain.model.encoder import ModelConfig

FEED_TARGET = 2.0  # the device backend's images/s over ResNet-50's step rate
E2E_TARGET = 0.9  # training from shards over the same step on synthetic data
TARGET_WORKERS = 4  # the device backend meets FEED_TARGET with at most this many workers


def jpeg_shards(work: Path, count: int, size: tuple[int, int]) -> tuple[Path, float]:
    """``count`` JPEGs of ``size`` written by every core, made into shards; the shards'
    folder and the JPEGs' mean size in KiB."""
    from bench.data_pipeline import write_jpegs
    from data_pipeline.config import ShardsConfig
    from data_pipeline.make_shards import make_shards

    cores = os.cpu_count() or 1
    tree, shards = work / f"jpegs-{size[0]}x{size[1]}", work / f"shards-{size[0]}x{size[1]}"
    chunk = math.ceil(count / cores)
    with ProcessPoolExecutor(cores) as pool:
        for written in [pool.submit(write_jpegs, tree, min(count, start + chunk), size, start)
                        for start in range(0, count, chunk)]:
            written.result()
    files = list(tree.rglob("*.JPEG"))
    kib = sum(f.stat().st_size for f in files) / len(files) / 1024
    make_shards(ShardsConfig(source="imagenet", input=str(tree), output=str(shards),
                             shard_size=max(1, math.ceil(count / (2 * cores))), workers=cores))
    return shards, kib


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


def feed(sizes: Sizes, device: torch.device, work: Path, **_: Any) -> dict[str, Any]:
    """Each backend's images/s against each backbone's step rate."""
    from bench.data_pipeline import time_stream

    shards, kib = jpeg_shards(work, sizes.feed_images, sizes.e2e_jpeg_sizes[0])
    steps = {backbone: synthetic_rate(backbone, sizes, device, work)[0]
             for backbone in sizes.step_backbones}
    rows = [{"source": f"step: {backbone}", "images_s": rate} for backbone, rate in steps.items()]
    cores = os.cpu_count() or 1
    first = sizes.step_backbones[0]
    for backend, workers in sizes.feed_cases:
        if workers > cores:
            rows.append({"source": backend, "workers": workers, "note": f"{cores} cores"})
            continue
        stream = functools.partial(time_stream, shards, sizes.step_images, workers,
                                   backend=backend, device=device,
                                   resolution=sizes.step_resolution)
        stream()  # warm-up: page cache, imports in the workers, the decoder's set-up
        rate = stream()
        row = {"source": backend, "workers": workers, "jpeg_kib": kib, "images_s": rate,
               **{f"x_{i}": rate / steps[b] for i, b in enumerate(sizes.step_backbones)}}
        if backend != "cpu" and workers <= TARGET_WORKERS:
            row["target"] = "met" if rate >= FEED_TARGET * steps[first] else "not met"
        rows.append(row)
        print(f"  {backend} x{workers}: {rate:.0f} images/s", flush=True)
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


def pretrain_from_shards(shards: Path, backbone: str, sizes: Sizes, work: Path) -> list[dict]:
    """One process of ``app.pretrain`` for ``e2e_steps`` steps (one epoch of ``shards``):
    its metric rows after the first window (which holds start-up)."""
    name = f"{backbone.replace(':', '-')}-{shards.name}"
    config = ["--config", str(REPO / "launch/configs/demo.yaml"), f"name={name}",
              "tracking.enabled=false", "objective.name=infonce", "objective.xclr.class_graph=",
              f"data.shards={shards}", f"data.batch_size={sizes.step_images}",
              f"data.workers={sizes.e2e_workers}", "data.backend=nvjpeg",
              f"data.resolution={sizes.step_resolution}", "data.crop_min_scale=0.08",
              f"model.backbone={backbone}", "model.small_stem=false",
              f"model.image_size={sizes.step_resolution}", "model.width=64",
              "optim.name=lars", "optim.lr=0.3", "optim.weight_decay=1e-6",  # as the synthetic
              "optim.warmup_steps=2",
              "train.epochs=1", f"train.log_every={sizes.e2e_window}", "train.progress=false",
              "checkpoint.every=0"]
    log = work / f"{name}.log"
    rows = window_rates(stage(config, log, "app.pretrain"))
    return rows[1:] or rows


def e2e(sizes: Sizes, device: torch.device, work: Path, **_: Any) -> dict[str, Any]:
    """Each model trained from each size of JPEG against its synthetic step rate."""
    rows = []
    images = sizes.e2e_steps * sizes.step_images  # one epoch: no worker restarts inside
    synthetic_rates = {b: synthetic_rate(b, sizes, device, work) for b in sizes.e2e_backbones}
    for size in sizes.e2e_jpeg_sizes:
        shards, kib = jpeg_shards(work, images, size)
        for backbone, (synthetic, precision) in synthetic_rates.items():
            windows = pretrain_from_shards(shards, backbone, sizes, work)
            rate = statistics.median(w["images_per_s"] for w in windows) / 2  # views -> images
            tflops = statistics.median(w["train/tflops"] for w in windows)
            mfu = [w["train/mfu"] for w in windows if "train/mfu" in w]
            rows.append({"model": backbone, "jpeg": f"{size[0]}x{size[1]}", "jpeg_kib": kib,
                         "precision": precision, "workers": sizes.e2e_workers,
                         "images_s": rate, "synthetic_images_s": synthetic,
                         "vs_synthetic": rate / synthetic, "tflops": tflops,
                         "mfu": statistics.median(mfu) if mfu else None,
                         "target": "met" if rate >= E2E_TARGET * synthetic else "not met"})
            print(f"  {backbone} from {size}: {rate:.0f} images/s, synthetic {synthetic:.0f}",
                  flush=True)
    return {"rows": rows, "ok": bool(rows),
            "summary": f"data.backend=nvjpeg, {sizes.e2e_workers} workers; target >= "
                       f"{E2E_TARGET:g}x synthetic: "
                       f"{sum(r['target'] == 'met' for r in rows)}/{len(rows)} met"}
