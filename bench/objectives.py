"""Forward + backward time and peak memory of every objective against lightly's NTXentLoss,
pytorch-metric-learning's SupConLoss and open_clip's SigLipLoss, side by side in one
process.

    python -m bench.objectives                  # N in 1024 4096 8192, D = 128
    python -m bench.objectives --sizes 1024     # the smallest case

N counts all embeddings: N/2 images x 2 views (lightly gets the two views as out0/out1;
clip gets N/2 images and N/2 texts). 100 classes; captions are 384-d (all-MiniLM-L6-v2).

Targets: every objective within 1.3x of the fastest peer at N = 8192; xclr within 1.1x of
infonce (checked for the class-graph and the caption path separately); siglip within 1.3x
of open_clip's SigLipLoss on the same N/2 image-text pairs. Writes
bench/results/objectives.json and prints a table. The peers are the ``bench`` extra
(``bash launch/setup.sh dev,bench``).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import torch

from bench.common import (
    keep_freed_memory,
    machine,
    peak_memory_bytes,
    print_table,
    time_interleaved,
    write_json,
)
from pretrain.losses import batch_loss

CAPTION_DIM = 384  # all-MiniLM-L6-v2
NUM_CLASSES = 100
TARGET_N = 8192


def objective_cases(z, ids, labels, captions, graph, text, table, tile_size=None):
    def case(name, **kw):
        return lambda: batch_loss(name, z, ids, labels, temperature=0.1, tile_size=tile_size,
                                  **kw)[0]

    return {
        "infonce": case("infonce"),
        "supcon": case("supcon"),
        "sincere": case("sincere"),
        "eps_supinfonce": case("eps_supinfonce", eps=0.1),
        "flatnce": case("flatnce"),
        "holder_flatnce": case("holder_flatnce", gamma=2.0),
        "xclr[captions]": case("xclr", captions=captions),
        "xclr[class_graph]": case("xclr", class_graph=graph),
        # the number of classes, as a run passes it (label groups are the classes)
        "projnce[centroid]": case("projnce", num_classes=table.shape[0]),
        "projnce[kernel]": case("projnce", projection="kernel", num_classes=table.shape[0]),
        "projnce[median]": case("projnce", projection="median", num_classes=table.shape[0]),
        "projnce[learned]": case("projnce", projection="learned", class_embeddings=table),
        # N embeddings = N/2 images + N/2 texts, as N counts both views for the others
        "clip": lambda: batch_loss("clip", z[: len(z) // 2], ids[: len(z) // 2],
                                   text=text[: len(z) // 2], temperature=0.1,
                                   tile_size=tile_size)[0],
        "siglip": lambda: batch_loss("siglip", z[: len(z) // 2], ids[: len(z) // 2],
                                     text=text[: len(z) // 2], temperature=0.1, bias=-10.0,
                                     tile_size=tile_size)[0],
    }


def peer_cases(z, labels, text):
    from lightly.loss import NTXentLoss
    from open_clip.loss import SigLipLoss
    from pytorch_metric_learning.losses import SupConLoss

    ntxent, supcon, siglip = NTXentLoss(temperature=0.1), SupConLoss(temperature=0.1), SigLipLoss()
    half = z.shape[0] // 2
    normalize = torch.nn.functional.normalize
    return {
        "lightly NTXentLoss": lambda: ntxent(z[:half], z[half:]),
        "pml SupConLoss": lambda: supcon(z, labels),
        # the same N/2 images and texts as siglip; open_clip's model normalises the features
        "open_clip SigLipLoss": lambda: siglip(normalize(z[:half], dim=1),
                                               normalize(text[:half], dim=1), 10.0, -10.0),
    }


def run_size(n: int, dim: int, repeats: int, device: torch.device) -> list[dict]:
    gen = torch.Generator().manual_seed(n)
    images = n // 2
    z = torch.randn(n, dim, generator=gen).to(device).requires_grad_()
    ids = torch.arange(images).repeat(2).to(device)  # view 1 rows, then view 2 rows
    labels = (ids % NUM_CLASSES).to(device)
    captions = torch.randn(images, CAPTION_DIM, generator=gen).half().to(device)[ids]
    names = torch.randn(NUM_CLASSES, CAPTION_DIM, generator=gen)
    names = torch.nn.functional.normalize(names, dim=1)
    graph = (names @ names.T).to(device)
    text = torch.randn(n, dim, generator=gen).to(device).requires_grad_()
    table = torch.randn(NUM_CLASSES, dim, generator=gen).to(device).requires_grad_()

    def step(loss_fn: Callable[[], torch.Tensor]) -> Callable[[], None]:
        def run() -> None:
            z.grad = None
            loss_fn().backward()
        return run

    cases = {**peer_cases(z, labels, text), **objective_cases(z, ids, labels, captions, graph,
                                                        text, table)}
    cases = {name: step(fn) for name, fn in cases.items()}
    seconds = time_interleaved(cases, rounds=repeats)
    rows = []
    for name, fn in cases.items():
        peak = peak_memory_bytes(fn, device)
        rows.append({"N": n, "loss": name, "fwd_bwd_ms": seconds[name] * 1e3,
                     "peak_mib": peak / 2**20,
                     "peer": name.startswith(("lightly", "pml", "open_clip"))})
        print(f"  N={n} {name}: {seconds[name] * 1e3:.1f} ms", flush=True)
    # the softmax peers run on all N rows; open_clip's SigLipLoss is siglip's own peer
    fastest_peer = min(r["fwd_bwd_ms"] for r in rows
                       if r["peer"] and not r["loss"].startswith("open_clip"))
    ms = {r["loss"]: r["fwd_bwd_ms"] for r in rows}
    for row in rows:
        row["vs_fastest_peer"] = row["fwd_bwd_ms"] / fastest_peer
        if row["loss"].startswith("xclr"):
            row["vs_infonce"] = row["fwd_bwd_ms"] / ms["infonce"]
        if row["loss"] == "siglip":
            row["vs_open_clip"] = row["fwd_bwd_ms"] / ms["open_clip SigLipLoss"]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 4096, 8192])
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=7, help="interleaved timing rounds")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=Path("bench/results/objectives.json"))
    args = parser.parse_args()
    device = torch.device(args.device)
    allocator_tuned = device.type == "cpu" and keep_freed_memory()
    rows = [row for n in args.sizes for row in run_size(n, args.dim, args.repeats, device)]
    at_target = [r for r in rows if r["N"] == TARGET_N and not r["peer"]]
    checks = {}
    if at_target:
        checks[f"every objective <= 1.3x fastest peer at N={TARGET_N}"] = all(
            r["vs_fastest_peer"] <= 1.3 for r in at_target)
        for row in at_target:
            if "vs_infonce" in row:
                checks[f"{row['loss']} <= 1.1x infonce at N={TARGET_N}"] = row["vs_infonce"] <= 1.1
            if "vs_open_clip" in row:
                checks[f"siglip <= 1.3x open_clip's SigLipLoss at N={TARGET_N}"] = (
                    row["vs_open_clip"] <= 1.3)
    write_json(args.out, {"machine": machine(), "dim": args.dim, "rows": rows,
                          "targets": checks, "cpu_allocator_keeps_freed_memory": allocator_tuned})
    print_table(rows, ["N", "loss", "fwd_bwd_ms", "peak_mib", "vs_fastest_peer", "vs_infonce",
                       "vs_open_clip"])
    for name, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}  {name}")
    if not checks:
        print(f"targets are defined at N={TARGET_N}; add it to --sizes to check them")


if __name__ == "__main__":
    main()
