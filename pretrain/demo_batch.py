"""Every objective on one real batch of the demo data: ``python -m pretrain.demo_batch``.

Streams one training batch (two augmented views per digit), embeds it with a fixed random
projection of the pixels and its caption embeddings from the caption store, and prints each
objective's loss and metrics with the class graph driving X-CLR. A smoke run of the data and
objective stages together until the training stage lands.
"""

from __future__ import annotations

from pathlib import Path

import torch

from data_pipeline.graph.class_graph import load_class_graph
from data_pipeline.loader import train_batches
from pretrain.cli import parse_run_config
from pretrain.losses import OBJECTIVES, batch_loss


def main() -> None:
    config = parse_run_config("demo_batch", __doc__)
    data = config.data
    store = Path(config.graph.output)
    if (store / "meta.json").is_file():
        data.caption_store = str(store)
    batch = next(iter(train_batches(data)))
    torch.manual_seed(config.seed)
    pixels = batch["images"].flatten(1)
    z = pixels @ torch.randn(pixels.shape[1], 64) / pixels.shape[1] ** 0.5
    graph_file = store / "class_graph.npz"
    graph = torch.from_numpy(load_class_graph(graph_file)[0]) if graph_file.is_file() else None
    captions = batch.get("caption_embeddings")
    print(f"batch: {tuple(batch['images'].shape)} images, {len(set(batch['keys']))} instances")
    for name in OBJECTIVES:
        extra = {"text": torch.randn_like(z)} if name == "clip" else {}
        if name == "xclr":
            extra = {"class_graph": graph} if graph is not None else {"captions": captions}
            if graph is None and captions is None:
                print(f"  {name:15s} skipped: no class graph or caption store in {store} "
                      "(run graph-precompute)")
                continue
        loss, metrics = batch_loss(name, z, batch["ids"], batch.get("labels"),
                                   temperature=config.objective.temperature, **extra)
        shown = ", ".join(f"{k}={float(v):.3f}" for k, v in metrics.items()
                          if k in ("infonce", "ess", "pos_sim", "neg_sim"))
        print(f"  {name:15s} loss={float(loss):.4f}  {shown}")


if __name__ == "__main__":
    main()
