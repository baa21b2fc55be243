"""Activation checkpointing (``model.activation_checkpointing``): the activations a training
forward keeps, the peak tensor memory and the time of one forward + backward of the encoder,
none against full and every 2nd block, in one process (ratios against ``none``, timed
interleaved).

    python -m bench.perf.activation_checkpointing    # ResNet-50 and ViT-B/16, 224 px, batch 8
    python -m bench.perf.activation_checkpointing --device cuda --dtype bfloat16 --batch 64 \\
        --backbones resnet50 vit_base_patch16_224 vit_large_patch16_224

Writes ``bench/results/checkpointing.json`` and prints a table; ``--record`` also writes
``bench/records/perf/checkpointing_<device>.json``, whose view ``table`` docs/benchmarks.md
shows.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.common import (
    held_memory_bytes,
    machine,
    peak_memory_bytes,
    print_table,
    time_interleaved,
    write_json,
)
from bench.records import invocation, provenance, source_line, write_record
from pretrain.model.encoder import ModelConfig, build_model
from pretrain.objectives import ObjectiveConfig

BACKBONES = {"resnet50": {"backbone": "resnet50", "small_stem": False},
             "vit_base_patch16_224": {"backbone": "timm:vit_base_patch16_224",
                                      "image_size": 224},
             "vit_large_patch16_224": {"backbone": "timm:vit_large_patch16_224",
                                       "image_size": 224}}
SETTINGS = ("none", "full", 2)
RENDERER = "bench.perf.activation_checkpointing"  # this module, by the name a record imports it
SHOWN = {"resnet50": "ResNet-50", "vit_base_patch16_224": "ViT-B/16",
         "vit_large_patch16_224": "ViT-L/16"}
WORDS = {"2": "every 2nd"}


class Passes:
    """One encoder under one checkpointing setting: its forward (graph kept) and its
    training pass (forward + backward), on fixed images."""

    def __init__(self, keys: dict, setting, images: torch.Tensor, dtype: torch.dtype):
        cfg = ModelConfig(**keys, activation_checkpointing=setting)
        torch.manual_seed(0)
        model = build_model(cfg, ObjectiveConfig.of("infonce"), images.device).train()
        self.encoder = model.encoder.to(memory_format=torch.channels_last)
        self.images = images
        self.autocast: Callable[[], contextlib.AbstractContextManager] = (
            (lambda: torch.autocast(images.device.type, dtype=dtype))
            if dtype != torch.float32 else contextlib.nullcontext)

    def forward(self) -> torch.Tensor:
        with self.autocast():
            features, projections = self.encoder(self.images)
            return features.float().square().mean() + projections.float().square().mean()

    def train(self) -> None:
        self.forward().backward()
        self.encoder.zero_grad(set_to_none=True)


def measure(name: str, keys: dict, images: torch.Tensor, dtype: torch.dtype,
            rounds: int) -> list[dict]:
    passes = {str(s): Passes(keys, s, images, dtype) for s in SETTINGS}
    held = {s: held_memory_bytes(p.forward, images.device) for s, p in passes.items()}
    peaks = {s: peak_memory_bytes(p.train, images.device) for s, p in passes.items()}
    times = time_interleaved({s: p.train for s, p in passes.items()}, rounds)
    return [{"backbone": name, "checkpointing": s,
             "activations MiB": round(held[s] / 2**20),
             "activations / none": round(held[s] / held["none"], 2),
             "peak MiB": round(peaks[s] / 2**20),
             "memory / none": round(peaks[s] / peaks["none"], 2),
             "s": round(times[s], 4), "time / none": round(times[s] / times["none"], 2)}
            for s in passes]


def render_table(record: dict[str, Any]) -> list[str]:
    """The source, and each backbone's checkpointed settings against ``none``: the
    activations the forward keeps and the time of forward + backward."""
    got = record["figures"]
    return [f"{source_line(record)} {got['dtype']}, batch {got['batch']} at {got['size']} px:",
            "", "| backbone | checkpointing | activations MiB | activations / none | "
            "time / none |", "| --- | --- | --- | --- | --- |",
            *(f"| {SHOWN[r['backbone']]} | {WORDS.get(r['checkpointing'], r['checkpointing'])} | "
              f"{r['activations MiB']:,} | {r['activations / none']:.2f} | "
              f"{r['time / none']:.2f} |" for r in got["rows"] if r["checkpointing"] != "none")]


VIEWS = {"table": render_table}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backbones", nargs="+", choices=sorted(BACKBONES),
                        default=["resnet50", "vit_base_patch16_224"])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--out", type=Path, default=Path("bench/results/checkpointing.json"))
    parser.add_argument("--record", action="store_true",
                        help="also write bench/records/perf/checkpointing_<device>.json")
    args = parser.parse_args()
    seen = provenance(invocation())  # the tree the run starts from
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    images = torch.randn(args.batch, 3, args.size, args.size, device=device).to(
        memory_format=torch.channels_last)
    rows = [row for name in args.backbones
            for row in measure(name, BACKBONES[name], images, dtype, args.rounds)]
    figures = {"batch": args.batch, "size": args.size, "dtype": args.dtype, "rows": rows}
    write_json(args.out, {"machine": machine(), **figures})
    print_table(rows, list(rows[0]))
    if args.record:
        name = f"perf/checkpointing_{device.type}"
        print(f"record: {write_record(name, seen, RENDERER, figures)}")


if __name__ == "__main__":
    main()
