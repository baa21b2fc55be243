"""The kit's ``objectives`` part: every objective's forward + backward, dense at
``dense_n`` embeddings and over column tiles at ``tiled_n``, time and peak memory, beside
open_clip's ``ClipLoss`` and ``SigLipLoss`` where their [N/2, N/2] logits fit.

The cases are :func:`bench.perf.objectives.objective_cases`, the CPU benchmark's own. A case
whose time, extrapolated from its previous size (quadratic in N), would overrun the part's
deadline is skipped and says so; one that runs out of memory says that.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from bench.gpu.sizes import Sizes
from bench.perf.objectives import CAPTION_DIM, NUM_CLASSES, objective_cases

DIM = 128
BYTES = 4  # float32


def inputs(n: int, device: torch.device) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(n)
    images = n // 2
    ids = torch.arange(images).repeat(2)
    names = torch.nn.functional.normalize(torch.randn(NUM_CLASSES, CAPTION_DIM, generator=gen),
                                          dim=1)
    return {"z": torch.randn(n, DIM, generator=gen).to(device).requires_grad_(),
            "ids": ids.to(device), "labels": (ids % NUM_CLASSES).to(device),
            "captions": torch.randn(images, CAPTION_DIM, generator=gen).half().to(device)[
                ids.to(device)],
            "graph": (names @ names.T).to(device),
            "text": torch.randn(n, DIM, generator=gen).to(device).requires_grad_(),
            "table": torch.randn(NUM_CLASSES, DIM, generator=gen).to(device).requires_grad_()}


def open_clip_cases(x: dict[str, torch.Tensor], n: int, device: torch.device,
                    memory: int) -> dict[str, Callable[[], torch.Tensor]]:
    """open_clip's losses on the same N/2 image-text pairs as ``clip`` and ``siglip``,
    where their dense logits (and gradients, and softmax) fit in ``memory`` bytes."""
    try:
        from open_clip.loss import ClipLoss, SigLipLoss
    except ImportError:
        return {}
    half = n // 2
    if 4 * half * half * BYTES > memory:
        return {}
    scale, bias = torch.tensor(10.0, device=device), torch.tensor(-10.0, device=device)
    clip, siglip = ClipLoss(), SigLipLoss()

    def pairs() -> tuple[torch.Tensor, torch.Tensor]:  # open_clip's model normalises these
        normalize = torch.nn.functional.normalize
        return normalize(x["z"][:half], dim=1), normalize(x["text"][:half], dim=1)

    return {"open_clip ClipLoss": lambda: clip(*pairs(), scale),
            "open_clip SigLipLoss": lambda: siglip(*pairs(), scale, bias)}


def measure(fn: Callable[[], torch.Tensor], x: dict[str, torch.Tensor],
            device: torch.device) -> tuple[float, float]:
    """(seconds, peak bytes above the inputs) of one forward + backward, timed with CUDA
    events on a GPU."""
    for value in x.values():
        value.grad = None
    if device.type != "cuda":
        start = time.perf_counter()
        fn().backward()
        return time.perf_counter() - start, float("nan")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    fn().backward()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) / 1e3, float(torch.cuda.max_memory_allocated() - before)


def tile_size(n: int, sizes: Sizes) -> int:
    """The widest power-of-two tile whose [N, T] float32 buffer stays under tile_bytes."""
    t = 1
    while t * 2 * n * BYTES <= sizes.tile_bytes and t < n:
        t *= 2
    return t


def objectives(sizes: Sizes, device: torch.device, deadline: float, rows: list,
               **_: Any) -> dict[str, Any]:
    memory = (torch.cuda.get_device_properties(device).total_memory
              if device.type == "cuda" else 2**30)
    last = {}  # case -> (N, seconds) of its previous size
    plan = [(n, None) for n in sizes.dense_n] + [(n, tile_size(n, sizes))
                                                 for n in sizes.tiled_n]
    for n, tile in plan:
        x = inputs(n, device)
        cases = {**open_clip_cases(x, n, device, memory // 2),
                 **objective_cases(x["z"], x["ids"], x["labels"], x["captions"], x["graph"],
                                   x["text"], x["table"], tile_size=tile)}
        for name, fn in cases.items():
            row = {"N": n, "tile": tile or "dense", "loss": name}
            previous = last.get(name)
            predicted = previous[1] * (n / previous[0]) ** 2 if previous else 0.0
            if time.monotonic() + 2 * predicted > deadline:
                row["note"] = f"skipped: about {predicted:.0f} s, past the part's budget"
            else:
                try:
                    if previous is None:
                        measure(fn, x, device)  # warm-up: kernels, allocator
                    seconds, peak = measure(fn, x, device)
                    row.update(fwd_bwd_ms=seconds * 1e3, peak_mib=peak / 2**20)
                    last[name] = (n, seconds)
                except torch.OutOfMemoryError:
                    row["note"] = "out of memory"
                    torch.cuda.empty_cache()
            rows.append(row)
            print(f"  N={n} {name}: {row.get('fwd_bwd_ms', row.get('note'))}", flush=True)
        del x, cases
    return {"rows": rows, "ok": True,
            "summary": f"{sum('fwd_bwd_ms' in r for r in rows)} of {len(rows)} cases measured"}
