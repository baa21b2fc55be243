"""Where does an image-text loss spend its gradient? For trained CLIP and SigLIP runs of the
learning benchmark, on batches of test image-caption pairs embedded by the run's own
encoder and text tower, at the run's own learned temperature (and bias):

- the pull on each row's positive (CLIP: 1 - softmax_ii, Radford et al. 2021; SigLIP:
  1 - sigmoid(t s_ii + b), Zhai et al. 2023, Eq. 1), split by whether the positive already
  ranks first among the batch's captions;
- the share of the push on negatives that goes to the negatives ranked above the
  positive (the ones retrieval counts against it).

Retrieval is a ranking, so a loss that spends its gradient on the rows still ranked wrong
improves it faster (docs/learning.md, "Image-text recipes").

    python -m bench.learning.gradient_by_rank bench/results/learning/runs/sweep_clip_epochs30-s0 \\
        bench/results/learning/runs/sweep_siglip_epochs30-s0 --test data/shards/cluttered-test
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from bench.common import print_table, write_json
from data_pipeline.config import DataConfig
from evaluation.features import extract
from evaluation.load import from_checkpoint
from evaluation.retrieval import embed_texts
from pretrain.run.checkpoint import list_checkpoints


def row_weights(similarity: Tensor, scale: float, bias: float | None) -> tuple[Tensor, Tensor]:
    """similarity [n, n] (image i's caption is column i) -> (pull on each row's positive
    [n], push on each pair [n, n], zero on the diagonal): the magnitudes of d loss / d s
    per unit of ``scale`` for the image-to-text rows, CLIP's softmax when ``bias`` is None,
    else SigLIP's sigmoid."""
    logits = scale * similarity
    p = logits.softmax(dim=1) if bias is None else torch.sigmoid(logits + bias)
    return 1 - p.diagonal(), p.masked_fill(torch.eye(len(p), dtype=torch.bool), 0)


def allocation(similarity: Tensor, scale: float, bias: float | None) -> dict[str, float]:
    """The gradient's allocation over one batch: mean pull on rows whose positive ranks
    first and on the others, and the share of the negatives' push on those above it."""
    pull, push = row_weights(similarity, scale, bias)
    positive = similarity.diagonal()
    above = similarity > positive[:, None]  # [n, n] negatives ranked above the positive
    first = ~above.any(dim=1)
    return {"rows_ranked_first": first.double().mean().item(),
            "pull_ranked_first": pull[first].mean().item() if first.any() else float("nan"),
            "pull_ranked_lower": pull[~first].mean().item() if (~first).any() else float("nan"),
            "push_share_above": (push[above].sum() / push.sum()).item()}


def embedded_pairs(run: Path, test: str) -> tuple[Tensor, Tensor, dict[str, float]]:
    """([M, D] test images, [M, D] their captions, both unit length; the run's learned
    t and b) from the run's newest checkpoint and its last logged row."""
    model, config = from_checkpoint(list_checkpoints(run)[0])
    cpu = torch.device("cpu")
    loader = DataConfig(shards=test, batch_size=256, workers=1,
                        resolution=config["data"]["resolution"])
    features = extract(model, loader, test, cpu, progress=False)
    texts = embed_texts(model, features.captions, cpu, 256)
    last = json.loads((run / "result.json").read_text())["training"]["last_row"]
    return F.normalize(features.projector, dim=1), texts, last


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="finished CLIP or SigLIP run dirs")
    parser.add_argument("--test", required=True, help="the test shards (with captions)")
    parser.add_argument("--batch", type=int, default=128, help="the recipes' global batch")
    parser.add_argument("--batches", type=int, default=50)
    parser.add_argument("--out", type=Path,
                        default=Path("bench/results/gradient_by_rank.json"))
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    for run in args.runs:
        images, texts, last = embedded_pairs(run, args.test)
        bias = last.get("bias")
        scale = 1 / last["temperature"]
        draw = torch.Generator().manual_seed(0)
        batches = [allocation(images[i] @ texts[i].T, scale, bias)
                   for i in (torch.randperm(len(images), generator=draw)[:args.batch]
                             for _ in range(args.batches))]
        rows.append({"run": run.name, "t": scale, "b": bias,
                     **{k: sum(b[k] for b in batches) / len(batches) for k in batches[0]}})
    print_table(rows, list(rows[0]))
    write_json(args.out, {"arguments": {k: str(v) for k, v in vars(args).items()},
                          "rows": rows})


if __name__ == "__main__":
    main()
