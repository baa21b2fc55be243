"""The kit's part that asks whether the device data path renders the views the CPU path
renders (``views``): the same shards of mixed-size JPEGs (landscape and portrait, from
thumbnails to 12 MP) streamed by the CPU backend and by ``data.backend=nvjpeg`` under each
installed JPEG decoder, batch by batch side by side, the same seed, so both draw the same
keys and view parameters; while a training step runs on the same GPU in a thread (the
allocator pressure under which torchvision's decoder overwrote memory queued kernels still
read, pytorch/vision PR #9606). Each device batch must hold the CPU batch's keys, only
finite values, no image dropped as corrupt, and a mean absolute difference within the CPU
test's bound (``tests/data_pipeline/dali/test_device.py``, ``DEVICE_BACKENDS``).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import torch

from bench.gpu.feed import jpeg_shards
from bench.gpu.sizes import Sizes
from data_pipeline.config import DataConfig
from data_pipeline.dali.jpeg import JPEG_DECODERS
from data_pipeline.loader import train_batches

LEVEL = 1 / 255 / 0.229  # one uint8 level after normalising (the largest of the channels)
BOUND = 1.5 * LEVEL  # nvjpeg's mean difference from the CPU path (its roi_align filter)


class Pressure:
    """A training step of a small CNN in a loop on the device's default stream, in a thread,
    until stopped: allocations and frees beside the render thread's."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.steps = device, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pressure", daemon=True)

    def __enter__(self) -> Pressure:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        model = torch.nn.Sequential(torch.nn.Conv2d(3, 64, 3, padding=1), torch.nn.ReLU(),
                                    torch.nn.Conv2d(64, 64, 3, padding=1)).to(self.device)
        while not self._stop.is_set():
            images = torch.randn(32, 3, 64, 64, device=self.device)
            model(images).square().mean().backward()
            self.steps += 1
            if self.device.type != "cuda":
                time.sleep(0.01)  # on the CPU: leave the cores to the loaders


def compare(shards: Path, decoder: str, sizes: Sizes, device: torch.device,
            deadline: float) -> dict[str, Any]:
    """One decoder's device batches against the CPU path's, batch by batch, until
    ``views_batches`` or the deadline."""
    common = {"shards": str(shards), "batch_size": sizes.views_batch,
              "resolution": sizes.views_resolution, "augment": "simclr",
              "crop_min_scale": 0.08, "seed": 3, "max_skip_fraction": 0.0,
              "workers": sizes.views_workers}  # the same chunk slots: the same batches
    cpu = DataConfig(**common, backend="cpu", draft_decode=False)
    gpu = DataConfig(**common, backend="nvjpeg", decoder=decoder)
    row = {"decoder": decoder, "batches": 0, "images": 0, "keys_differ": 0, "nonfinite": 0,
           "corrupt": 0, "mean_diff_levels": 0.0, "worst_batch_levels": 0.0}
    start = time.perf_counter()
    # both loaders' workers are started (forked) before the pressure thread runs torch ops
    pairs = zip(train_batches(cpu), train_batches(gpu, device=device), strict=True)
    compared(row, *next(pairs))
    ended = ""
    with Pressure(device) as pressure:
        while row["batches"] < sizes.views_batches and not ended:
            pair = next(pairs, None) if time.monotonic() < deadline else None
            if pair is None:
                ended = ("the deadline came first" if time.monotonic() >= deadline
                         else "the epoch ended first")
            else:
                compared(row, *pair)
    pairs = None  # the loaders' workers end with their generators
    row["mean_diff_levels"] /= max(1, row["batches"])
    row["pressure_steps"], row["seconds"] = pressure.steps, time.perf_counter() - start
    if ended:
        row["note"] = ended
    row["ok"] = (row["batches"] >= sizes.views_batches and not row["keys_differ"]
                 and not row["nonfinite"] and not row["corrupt"]
                 and row["worst_batch_levels"] <= BOUND / LEVEL)
    return row


def compared(row: dict[str, Any], want: dict[str, Any], got: dict[str, Any]) -> None:
    """``row``'s counts with one pair of batches (the CPU path's, the device's) added."""
    images = got["images"].float()
    diff = (images.cpu() - want["images"]).abs().mean().item() / LEVEL
    row["batches"] += 1
    row["images"] += len(got["keys"])
    row["keys_differ"] += got["keys"] != want["keys"]
    row["nonfinite"] += int((~torch.isfinite(images)).sum().item())
    row["corrupt"] += got["skipped"].get("corrupt_image", 0)
    row["mean_diff_levels"] += diff
    row["worst_batch_levels"] = max(row["worst_batch_levels"], diff)


def views(sizes: Sizes, device: torch.device, work: Path, deadline: float, rows: list,
          **_: Any) -> dict[str, Any]:
    shards, _ = jpeg_shards(work, sizes.views_jpegs, "mixed")
    names = [name for name, decoder in JPEG_DECODERS.items() if decoder.available()]
    rows.extend({"decoder": name, "ok": None,
                 "note": f"not installed: {JPEG_DECODERS[name].install_hint}"}
                for name in JPEG_DECODERS if name not in names)
    for done, name in enumerate(names):  # each decoder an equal share of the time left
        share = (deadline - time.monotonic()) / (len(names) - done)
        rows.append(compare(shards, name, sizes, device, time.monotonic() + share))
        print(f"  {name}: {rows[-1]}", flush=True)
    measured = [r for r in rows if r["ok"] is not None]
    return {"rows": rows, "ok": bool(measured) and all(r["ok"] for r in measured),
            "summary": f"device views against the CPU path, worst batch within "
                       f"{BOUND / LEVEL:g} levels, no non-finite or corrupt image: "
                       + ", ".join(f"{r['decoder']} {'ok' if r['ok'] else 'FAILED'}"
                                   for r in measured)}
