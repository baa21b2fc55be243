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
"""

from __future__ import annotations

import argparse
import math
import os
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torchvision.datasets import ImageFolder
from torchvision.models import resnet50
from torchvision.transforms import v2

from bench.common import machine, print_table, write_json
from data_pipeline.config import DataConfig, ShardsConfig
from data_pipeline.dali import dali_available
from data_pipeline.digits import DigitsSource
from data_pipeline.loader import train_batches
from data_pipeline.make_shards import make_shards
from data_pipeline.manifest import Manifest
from data_pipeline.tario import iter_shard
from data_pipeline.transforms import simclr_view

RESOLUTION = 224


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
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    size = tuple(int(x) for x in args.size.split("x"))
    suffix = "" if args.size == "400x350" else f"-{args.size}"
    out = args.out or Path(f"bench/results/data_pipeline{suffix}.json")
    name = f"{args.size}-{args.images}"
    tree, shards = args.workdir / f"jpegs-{name}", args.workdir / f"shards-{name}"
    if not tree.exists():
        write_jpegs(tree, args.images, size)
    # at least two shards per worker: a shard is read by one worker, so with fewer shards
    # than workers the stream would run on fewer cores than ImageFolder
    shard_size = max(1, min(100, math.ceil(args.images / (2 * cores))))
    make_shards(ShardsConfig(source="imagenet", input=str(tree), output=str(shards),
                             shard_size=shard_size, workers=cores))
    mean_kb = np.mean([p.stat().st_size for p in tree.rglob("*.JPEG")]) / 1024
    rounds = {"stream": [], "imagefolder": [], "imagefolder_our_transforms": [],
              "stream_full_decode": []}
    for _ in range(3):  # interleaved rounds
        rounds["stream"].append(time_stream(shards, args.batch, cores))
        rounds["stream_full_decode"].append(time_stream(shards, args.batch, cores, False))
        rounds["imagefolder"].append(time_imagefolder(tree, args.batch, cores, stock=True))
        rounds["imagefolder_our_transforms"].append(
            time_imagefolder(tree, args.batch, cores, stock=False))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dali_available():  # DALI's CPU operators here, nvJPEG with a GPU
        rounds["dali"] = [time_stream(shards, args.batch, cores, backend="dali", device=device)
                          for _ in range(3)]
    stream, folder, folder_ours, full = (float(np.median(rounds[k])) for k in (
        "stream", "imagefolder", "imagefolder_our_transforms", "stream_full_decode"))
    tar_samples, tar_mib = tar_read_rate(shards)
    rows = [
        {"loader": "WebDataset stream (ours)", "images_per_s": stream,
         "per_core": stream / cores, "vs_imagefolder": stream / folder},
        {"loader": "WebDataset stream, full-size decode (data.draft_decode=false)",
         "images_per_s": full, "per_core": full / cores, "vs_imagefolder": full / folder},
        {"loader": "ImageFolder + DataLoader, torchvision transforms", "images_per_s": folder,
         "per_core": folder / cores, "vs_imagefolder": 1.0},
        {"loader": "ImageFolder + DataLoader, our transforms", "images_per_s": folder_ours,
         "per_core": folder_ours / cores, "vs_imagefolder": folder_ours / folder},
        {"loader": "raw tar read (no decode)", "images_per_s": tar_samples,
         "per_core": tar_samples, "vs_imagefolder": None},
    ]
    if "dali" in rounds:
        dali = float(np.median(rounds["dali"]))
        rows.insert(2, {"loader": f"WebDataset stream, data.backend=dali on {device.type}",
                        "images_per_s": dali, "per_core": dali / cores,
                        "vs_imagefolder": dali / folder})
    if args.step_rate:
        rate = step_rate(args.batch, device)
        rows.append({"loader": f"ResNet-50 training steps on {device.type} (to feed)",
                     "images_per_s": rate, "per_core": None, "vs_imagefolder": None})
    write_json(out, {"machine": machine(), "cores": cores, "images": args.images,
                          "size": args.size,
                          "mean_jpeg_kib": mean_kb, "resolution": RESOLUTION, "rows": rows,
                          "tar_mib_per_s": tar_mib, "rounds": rounds,
                          "target_at_least_1x": stream >= folder})
    print(f"{args.images} JPEGs of {args.size}, mean {mean_kb:.0f} KiB, two {RESOLUTION}px "
          f"SimCLR views each, {cores} workers")
    print_table(rows, ["loader", "images_per_s", "per_core", "vs_imagefolder"])
    print(f"raw tar read: {tar_mib:.0f} MiB/s")
    print(f"{'PASS' if stream >= folder else 'FAIL'}  stream >= 1.0x ImageFolder")


if __name__ == "__main__":
    main()
