"""Does a backbone fit the labels at all? Supervised cross-entropy outside the pipeline:
the training canvases held in memory as fixed evaluation views (no augmentation), batches
drawn at random, plain AdamW, test top-1 every ``--every`` steps. Separates a backbone
that cannot fit the data from a recipe that fails (docs/learning.md, "A transformer on
the cluttered digits").

    python -m bench.learning.supervised --shards data/shards/cluttered --model timm:test_vit \\
        --timm-kwargs "{patch_size: 4}" --steps 2000
    python -m bench.learning.supervised --shards data/shards/cluttered --model small_cnn \\
        --steps 200
    python -m bench.learning.supervised --shards data/shards/cluttered --model timm:test_vit \\
        --timm-kwargs "{patch_size: 8, global_pool: avg, class_token: false}" \\
        --vit-stem hybrid --steps 200

``--shards`` names the folder prefix of ``-train`` and ``-test`` shards (make-shards
output). Writes JSON beside its table (``--out``).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import yaml

from bench.common import print_table, write_json
from data_pipeline.config import DataConfig
from data_pipeline.loader import eval_batches
from pretrain.model.encoder import Encoder, ModelConfig


def canvases(shards: str, resolution: int) -> tuple[torch.Tensor, torch.Tensor]:
    """([M, 3, R, R] evaluation views, [M] labels) of every sample of ``shards``."""
    cfg = DataConfig(shards=shards, batch_size=500, workers=0, resolution=resolution)
    batches = list(eval_batches(cfg))
    return (torch.cat([b["images"] for b in batches]),
            torch.cat([b["labels"] for b in batches]))


def backbone(args: argparse.Namespace) -> tuple[torch.nn.Module, int]:
    """The backbone ``args.model`` (``small_cnn``, ``timm:<model>``) as a run builds it,
    at width 32 (the cluttered recipes' CNN and the hybrid stem's first block)."""
    timm = args.model.startswith("timm:")
    timm_kwargs = (yaml.safe_load(args.timm_kwargs) or {}) if timm else {}
    encoder = Encoder(ModelConfig(backbone=args.model, width=32, image_size=args.resolution,
                                  timm_kwargs={k: v for k, v in timm_kwargs.items()
                                               if k != "patch_size"},
                                  patch_size=timm_kwargs.get("patch_size", 0),
                                  vit_stem=args.vit_stem if timm else "patch", norm=args.norm,
                                  projector_bn_out=args.norm == "batch"))
    return encoder.backbone, encoder.feature_dim


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", required=True)
    parser.add_argument("--model", default="timm:test_vit")
    parser.add_argument("--timm-kwargs", default="{}", help="YAML mapping")
    parser.add_argument("--vit-stem", choices=["patch", "conv", "hybrid"], default="patch",
                        help="model.vit_stem of a timm ViT")
    parser.add_argument("--norm", choices=["batch", "group"], default="batch",
                        help="model.norm: the convolutions' normalisation")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--resolution", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("bench/results/supervised.json"))
    args = parser.parse_args()
    train_x, train_y = canvases(f"{args.shards}-train", args.resolution)
    test_x, test_y = canvases(f"{args.shards}-test", args.resolution)
    torch.manual_seed(args.seed)
    net, features = backbone(args)
    model = torch.nn.Sequential(net, torch.nn.Linear(features, int(train_y.max()) + 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    draw = torch.Generator().manual_seed(args.seed)
    rows, start = [], time.perf_counter()
    for step in range(1, args.steps + 1):
        index = torch.randint(0, len(train_x), (args.batch,), generator=draw)
        loss = torch.nn.functional.cross_entropy(model(train_x[index]), train_y[index])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step % args.every == 0 or step == args.steps:
            model.eval()
            with torch.no_grad():
                top1 = (model(test_x).argmax(1) == test_y).float().mean().item()
            model.train()
            rows.append({"step": step, "train_loss": loss.item(), "test_top1": top1,
                         "seconds": time.perf_counter() - start})
            print(rows[-1], flush=True)
    print_table(rows, ["step", "train_loss", "test_top1", "seconds"])
    write_json(args.out, {"arguments": {k: str(v) for k, v in vars(args).items()},
                          "rows": rows})


if __name__ == "__main__":
    main()
