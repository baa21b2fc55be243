"""The images' memory format (``model.channels_last``): the time of one training step of the
encoder (forward, backward, AdamW) with contiguous images against channels-last images, the
weights left contiguous as on CPU, in one process (ratios against contiguous, timed
interleaved).

    python -m bench.perf.channels_last                     # small CNN (width 32), 32 px, batch 128
    python -m bench.perf.channels_last --backbones small_cnn resnet18 --batch 256 --threads 2

Writes ``bench/results/channels_last.json`` and prints a table; ``--record`` also writes
``bench/records/perf/channels_last.json`` (view ``summary``).
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

import torch

from bench.common import machine, print_table, time_interleaved, write_json
from bench.records import invocation, provenance, source_line, write_record
from pretrain.model.encoder import Encoder, ModelConfig

BACKBONES = {"small_cnn": {"backbone": "small_cnn", "width": 32},
             "resnet18": {"backbone": "resnet18", "small_stem": True}}
NAME = "perf/channels_last"
RENDERER = "bench.perf.channels_last"  # this module, by the name a record imports it
WORDS = {"small_cnn": "small CNN, width 32", "resnet18": "ResNet-18"}


class Step:
    """One encoder's training step on fixed images, in one memory format."""

    def __init__(self, cfg: ModelConfig, images: torch.Tensor) -> None:
        torch.manual_seed(0)
        self.encoder = Encoder(cfg).train()
        self.optimizer = torch.optim.AdamW(self.encoder.parameters())
        self.images = images

    def __call__(self) -> None:
        features, projections = self.encoder(self.images)
        (features.square().mean() + projections.square().mean()).backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def measure(name: str, keys: dict, images: torch.Tensor, rounds: int) -> list[dict]:
    cfg = ModelConfig(**keys)
    steps = {"contiguous": Step(dataclasses.replace(cfg, channels_last=False), images),
             "channels_last": Step(dataclasses.replace(cfg, channels_last=True), images)}
    times = time_interleaved(steps, rounds)
    return [{"backbone": name, "images": fmt, "ms": round(1000 * times[fmt], 1),
             "time / contiguous": round(times[fmt] / times["contiguous"], 2)}
            for fmt in steps]


def render_summary(record: dict[str, Any]) -> list[str]:
    """The source, and each backbone's channels-last step against the contiguous one."""
    got = record["figures"]
    ratios = ", ".join(f"{r['time / contiguous']:.2f}x ({WORDS[r['backbone']]})"
                       for r in got["rows"] if r["images"] == "channels_last")
    return [f"- Channels-last images ({source_line(record)}): a step {ratios} of the "
            f"contiguous one, {got['batch']} images of {got['size']} px, {got['threads']} "
            "thread(s); `model.channels_last` is on by default."]


VIEWS = {"summary": render_summary}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backbones", nargs="+", choices=sorted(BACKBONES),
                        default=["small_cnn"])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("bench/results/channels_last.json"))
    parser.add_argument("--record", action="store_true",
                        help=f"also write bench/records/{NAME}.json")
    args = parser.parse_args()
    seen = provenance(invocation())  # the tree the run starts from
    torch.set_num_threads(args.threads)
    images = torch.randn(args.batch, 3, args.size, args.size)
    rows = [row for name in args.backbones
            for row in measure(name, BACKBONES[name], images, args.rounds)]
    figures = {"batch": args.batch, "size": args.size, "threads": args.threads, "rows": rows}
    write_json(args.out, {"machine": machine(), **figures})
    print_table(rows, list(rows[0]))
    if args.record:
        print(f"record: {write_record(NAME, seen, RENDERER, figures)}")


if __name__ == "__main__":
    main()
