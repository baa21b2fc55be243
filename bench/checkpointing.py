"""Activation checkpointing (``model.activation_checkpointing``): peak tensor memory and
time of one training forward + backward of the encoder, none against full and every 2nd
block, in one process (ratios against ``none``, timed interleaved).

    python -m bench.checkpointing                    # ResNet-50 and ViT-B/16, 224 px, batch 8

Writes ``bench/results/checkpointing.json`` and prints a table.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from bench.common import machine, peak_memory_bytes, print_table, time_interleaved, write_json
from pretrain.losses import ObjectiveConfig
from pretrain.model.encoder import ModelConfig, build_model

BACKBONES = {"resnet50": {"backbone": "resnet50", "small_stem": False},
             "vit_base_patch16_224": {"backbone": "timm:vit_base_patch16_224",
                                      "image_size": 224}}
SETTINGS = ("none", "full", 2)


def training_pass(keys: dict, setting, images: torch.Tensor):
    cfg = ModelConfig(**keys, activation_checkpointing=setting)
    torch.manual_seed(0)
    model = build_model(cfg, ObjectiveConfig.of("infonce"), torch.device("cpu")).train()

    def run() -> None:
        features, projections = model.encoder(images)
        (features.square().mean() + projections.square().mean()).backward()
        model.zero_grad(set_to_none=True)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench/results/checkpointing.json"))
    args = parser.parse_args()
    images = torch.randn(args.batch, 3, args.size, args.size)
    rows = []
    for name, keys in BACKBONES.items():
        passes = {str(s): training_pass(keys, s, images) for s in SETTINGS}
        peaks = {s: peak_memory_bytes(run, torch.device("cpu")) for s, run in passes.items()}
        times = time_interleaved(passes, args.rounds)
        for setting in passes:
            rows.append({"backbone": name, "checkpointing": setting,
                         "peak MiB": round(peaks[setting] / 2**20),
                         "memory / none": round(peaks[setting] / peaks["none"], 2),
                         "s": round(times[setting], 3),
                         "time / none": round(times[setting] / times["none"], 2)})
    write_json(args.out, {"machine": machine(), "batch": args.batch, "size": args.size,
                          "rows": rows})
    print_table(rows, list(rows[0]))


if __name__ == "__main__":
    main()
