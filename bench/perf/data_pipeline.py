"""Decode + two-view augmentation throughput of the training loader against torchvision's
``ImageFolder`` with a ``DataLoader`` and the same transforms on the same JPEGs, plus the
raw tar read rate.

    python -m bench.perf.data_pipeline                    # 600 JPEGs of ~400 x 350 px, 224 px views
    python -m bench.perf.data_pipeline --images 200       # quicker
    python -m bench.perf.data_pipeline --size 1000x750 --images 300   # full-size photos
    python -m bench.perf.data_pipeline --step-rate        # with a GPU: is ResNet-50 (bf16) fed?

The JPEGs are the bundled digits upsampled to ImageNet's mean size with film-grain noise,
so they compress like photographs (~60-90 KB) rather than like flat line drawings. Both
loaders use every core as a worker; the table reports images per second (each image gives
two augmented views) and per core. With DALI installed a row times ``data.backend=dali``:
nvJPEG and the views on the GPU when there is one, DALI's CPU operators otherwise.
``--record`` measures the three sizes docs/benchmarks.md shows and writes
``bench/records/perf/data_pipeline.json`` (view ``table``).
"""

from __future__ import annotations

import argparse
import math
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torchvision.datasets import ImageFolder
from torchvision.models import resnet50
from torchvision.transforms import v2

from bench.common import machine, print_table, write_json
from bench.records import invocation, provenance, source_line, write_record
from data_pipeline.config import DataConfig, ShardsConfig
from data_pipeline.dali import dali_available
from data_pipeline.digits import DigitsSource
from data_pipeline.loader import train_batches
from data_pipeline.make_shards import make_shards
from data_pipeline.manifest import Manifest
from data_pipeline.tario import iter_shard
from data_pipeline.transforms import simclr_view

RESOLUTION = 224
NAME = "perf/data_pipeline"
RENDERER = "bench.perf.data_pipeline"  # this module, by the name a record imports it
RECORD_CASES = (("400x350", 600, 32), ("1000x750", 200, 32), ("4000x3000", 96, 16))


def write_jpegs(root: Path, count: int, size: tuple[int, int] = (400, 350),
                start: int = 0) -> None:
    """JPEGs ``start`` to ``count - 1`` of the set under ``root``/class_<digit>/."""
    digits = DigitsSource(size=8)
    rng = np.random.default_rng(start)
    for i in range(start, count):
        label = int(digits.labels[i % len(digits)])
        base = Image.fromarray(digits.images[i % len(digits)]).resize(size, Image.BICUBIC)
        pixels = np.asarray(base.convert("RGB"), dtype=np.int16)
        pixels = pixels + rng.normal(0, 18, pixels.shape).astype(np.int16)
        tint = rng.integers(0, 60, 3, dtype=np.int16)
        image = Image.fromarray(np.clip(pixels + tint, 0, 255).astype(np.uint8))
        path = root / f"class_{label}" / f"img_{i:05d}.JPEG"
        path.parent.mkdir(parents=True, exist_ok=True)
        image.save(path, quality=90)


def stock_simclr_view() -> v2.Compose:
    """The SimCLR set as written with torchvision's own transforms (2-D Gaussian blur)."""
    return v2.Compose([
        v2.RandomResizedCrop(RESOLUTION, scale=(0.08, 1.0), antialias=True),
        v2.RandomHorizontalFlip(),
        v2.RandomApply([v2.ColorJitter(0.4, 0.4, 0.4, 0.1)], p=0.8),
        v2.RandomGrayscale(p=0.2),
        v2.RandomApply([v2.GaussianBlur(23, sigma=(0.1, 2.0))], p=0.5),
        v2.ToDtype(torch.float32, scale=True),
        v2.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
    ])


class TwoViews:
    def __init__(self, stock: bool) -> None:
        self.view = stock_simclr_view() if stock else simclr_view(RESOLUTION)

    def __call__(self, image: Image.Image) -> tuple[torch.Tensor, torch.Tensor]:
        tensor = torch.from_numpy(np.asarray(image.convert("RGB")).copy()).permute(2, 0, 1)
        return self.view(tensor), self.view(tensor)


def time_imagefolder(root: Path, batch: int, workers: int, stock: bool) -> float:
    dataset: Dataset = ImageFolder(str(root), transform=TwoViews(stock))
    loader = DataLoader(dataset, batch_size=batch, shuffle=True, num_workers=workers,
                        drop_last=True)
    start, images = time.perf_counter(), 0
    for (first, _second), _ in loader:
        images += first.shape[0]
    return images / (time.perf_counter() - start)


def time_stream(shards: Path, batch: int, workers: int, draft: bool = True,
                backend: str = "cpu", device: torch.device | None = None,
                resolution: int = RESOLUTION) -> float:
    cfg = DataConfig(shards=str(shards), batch_size=batch, workers=workers,
                     resolution=resolution, augment="simclr", crop_min_scale=0.08,
                     draft_decode=draft, backend=backend)
    start, images = time.perf_counter(), 0
    for b in train_batches(cfg, device=device):
        images += b["images"].shape[0] // 2
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
    return images / (time.perf_counter() - start)


def step_rate(batch: int, device: torch.device, steps: int = 5) -> float:
    """Images/s (two views each) of ResNet-50 training steps at 224 px on ``device`` (bf16
    autocast on CUDA), after two warm-up steps: the rate the loader has to feed."""
    model = resnet50().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    views = torch.randn(2 * batch, 3, RESOLUTION, RESOLUTION, device=device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    start = 0.0
    for step in range(steps + 2):
        if step == 2:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
        with torch.autocast(device.type, dtype=dtype, enabled=device.type == "cuda"):
            loss = model(views).float().logsumexp(dim=1).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return steps * batch / (time.perf_counter() - start)


def tar_read_rate(shards: Path) -> tuple[float, float]:
    manifest = Manifest.read(shards)
    start, samples, size = time.perf_counter(), 0, 0
    for info in manifest.shards:
        for _sample in iter_shard(shards / info.name):
            samples += 1
        size += info.bytes
    seconds = time.perf_counter() - start
    return samples / seconds, size / seconds / 2**20


def measure(images: int, size: str, batch: int, workdir: Path, step_rate_too: bool = False
            ) -> dict[str, Any]:
    """``images`` JPEGs of ``size`` ("WxH") through each loader, 3 interleaved rounds: the
    rows (images/s, per core, against ImageFolder) and the raw tar read rate."""
    cores = os.cpu_count() or 1
    name = f"{size}-{images}"
    tree, shards = workdir / f"jpegs-{name}", workdir / f"shards-{name}"
    if not tree.exists():
        write_jpegs(tree, images, tuple(int(x) for x in size.split("x")))
    # at least two shards per worker: a shard is read by one worker, so with fewer shards
    # than workers the stream would run on fewer cores than ImageFolder
    shard_size = max(1, min(100, math.ceil(images / (2 * cores))))
    make_shards(ShardsConfig(source="imagenet", input=str(tree), output=str(shards),
                             shard_size=shard_size, workers=cores))
    mean_kb = np.mean([p.stat().st_size for p in tree.rglob("*.JPEG")]) / 1024
    rounds: dict[str, list[float]] = {"stream": [], "imagefolder": [],
                                      "imagefolder_our_transforms": [], "stream_full_decode": []}
    for _ in range(3):  # interleaved rounds
        rounds["stream"].append(time_stream(shards, batch, cores))
        rounds["stream_full_decode"].append(time_stream(shards, batch, cores, False))
        rounds["imagefolder"].append(time_imagefolder(tree, batch, cores, stock=True))
        rounds["imagefolder_our_transforms"].append(
            time_imagefolder(tree, batch, cores, stock=False))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dali_available():  # DALI's CPU operators here, nvJPEG with a GPU
        rounds["dali"] = [time_stream(shards, batch, cores, backend="dali", device=device)
                          for _ in range(3)]
    median = {k: float(np.median(v)) for k, v in rounds.items()}
    folder = median["imagefolder"]
    tar_samples, tar_mib = tar_read_rate(shards)
    loaders = {"stream": "WebDataset stream (ours)",
               "stream_full_decode": "WebDataset stream, full-size decode "
                                     "(data.draft_decode=false)",
               "dali": f"WebDataset stream, data.backend=dali on {device.type}",
               "imagefolder": "ImageFolder + DataLoader, torchvision transforms",
               "imagefolder_our_transforms": "ImageFolder + DataLoader, our transforms"}
    rows = [{"loader": words, "key": key, "images_per_s": median[key],
             "per_core": median[key] / cores, "vs_imagefolder": median[key] / folder}
            for key, words in loaders.items() if key in median]
    rows.append({"loader": "raw tar read (no decode)", "key": "tar",
                 "images_per_s": tar_samples, "per_core": tar_samples, "vs_imagefolder": None})
    if step_rate_too:
        rows.append({"loader": f"ResNet-50 training steps on {device.type} (to feed)",
                     "key": "step", "images_per_s": step_rate(batch, device),
                     "per_core": None, "vs_imagefolder": None})
    print(f"{images} JPEGs of {size}, mean {mean_kb:.0f} KiB, two {RESOLUTION}px "
          f"SimCLR views each, {cores} workers")
    print_table(rows, ["loader", "images_per_s", "per_core", "vs_imagefolder"])
    print(f"raw tar read: {tar_mib:.0f} MiB/s")
    met = median["stream"] >= folder
    print(f"{'PASS' if met else 'FAIL'}  stream >= 1.0x ImageFolder")
    return {"cores": cores, "images": images, "size": size, "batch": batch,
            "mean_jpeg_kib": mean_kb, "resolution": RESOLUTION, "rows": rows,
            "tar_mib_per_s": tar_mib, "rounds": rounds, "target_at_least_1x": met}


def render_table(record: dict[str, Any]) -> list[str]:
    """The source; per JPEG size, each loader's images/s (ours against ImageFolder with
    torchvision's transforms); the raw tar read; the target."""
    cases = record["figures"]["cases"]
    columns = {"stream": "ours", "stream_full_decode": "ours, full-size decode",
               "dali": "`data.backend=dali`", "imagefolder": "ImageFolder, torchvision's "
               "transforms", "imagefolder_our_transforms": "ImageFolder, our transforms"}
    shown = [k for k in columns if any(r["key"] == k for c in cases for r in c["rows"])]

    def cell(case: dict[str, Any], key: str) -> str:
        row = next((r for r in case["rows"] if r["key"] == key), None)
        if row is None:
            return ""
        ratio = f" (**{row['vs_imagefolder']:.2f}x**)" if key == "stream" else ""
        return f"{row['images_per_s']:.1f}{ratio}"
    first = cases[0]
    tar = next(r for r in first["rows"] if r["key"] == "tar")
    stream = next(r for r in first["rows"] if r["key"] == "stream")
    met = all(c["target_at_least_1x"] for c in cases)
    return [f"{source_line(record)} Images/s, two {first['resolution']} px views an image, "
            f"{first['cores']} workers, median of 3 interleaved rounds:", "",
            "| JPEGs | " + " | ".join(columns[k] for k in shown) + " |",
            "| --- |" + " --- |" * len(shown),
            *(f"| {c['images']} of {c['size'].replace('x', ' x ')} "
              f"({c['mean_jpeg_kib']:.0f} KiB) | " + " | ".join(cell(c, k) for k in shown)
              + " |" for c in cases),
            "", f"Raw tar reads ({first['size'].replace('x', ' x ')}): "
            f"{tar['images_per_s']:,.0f} samples/s ({first['tar_mib_per_s']:.0f} MiB/s), "
            f"{tar['images_per_s'] / stream['images_per_s']:.0f}x the decode. Target, ours "
            f">= 1.0x ImageFolder at every size: **{'met' if met else 'not met'}**."]


VIEWS = {"table": render_table}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=600)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--size", default="400x350", help="JPEG width x height")
    parser.add_argument("--workdir", type=Path, default=Path("bench/results/data_pipeline"))
    parser.add_argument("--step-rate", action="store_true",
                        help="also time ResNet-50 training steps: is the GPU fed?")
    parser.add_argument("--out", type=Path, default=None,
                        help="default: bench/results/data_pipeline[-WxH].json")
    parser.add_argument("--record", action="store_true",
                        help=f"measure the sizes of {NAME}'s table ({RECORD_CASES}, as "
                             "(size, images, batch)) and write its record")
    args = parser.parse_args()
    seen = provenance(invocation())  # the tree the run starts from
    if args.record:
        cases = [measure(images, size, batch, args.workdir)
                 for size, images, batch in RECORD_CASES]
        print(f"record: {write_record(NAME, seen, RENDERER, {'cases': cases})}")
        return
    suffix = "" if args.size == "400x350" else f"-{args.size}"
    out = args.out or Path(f"bench/results/data_pipeline{suffix}.json")
    write_json(out, {"machine": machine(), **measure(args.images, args.size, args.batch,
                                                     args.workdir, args.step_rate)})


if __name__ == "__main__":
    main()
