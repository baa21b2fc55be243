"""``graph-precompute``: caption embeddings and similarity graphs.

    graph-precompute --config launch/configs/demo.yaml                 # embed every caption
    torchrun --nproc-per-node 4 -m app.graph_precompute ...            # 4 parts in parallel
    graph-precompute graph.task=class_graph graph.class_names=imagenet1k
    graph-precompute graph.task=neighbours graph.neighbours=10
    graph-precompute graph.task=show graph.key=digits_00007
"""

from __future__ import annotations

from collections.abc import Sequence

from app.run_config import parse_run
from core.cli import reported_faults
from data_pipeline.graph.class_graph import build_class_graph
from data_pipeline.graph.config import GraphConfig
from data_pipeline.graph.job import run_captions
from data_pipeline.graph.neighbours import build_neighbours, describe


def main(argv: Sequence[str] | None = None) -> None:
    config, _ = parse_run("graph-precompute", __doc__, argv)
    with reported_faults("graph-precompute"):
        run(config.graph)


def run(cfg: GraphConfig) -> None:
    if cfg.task == "captions":
        store = run_captions(cfg)
        if store is not None:
            meta = store.meta
            print(f"graph-precompute: {meta['num_keys']} captions, {meta['num_unique']} "
                  f"distinct ({meta['duplicate_rate']:.1%} duplicates), "
                  f"{meta['truncated']} truncated, skipped {meta['skipped'] or 'none'} "
                  f"-> {cfg.output}")
    elif cfg.task == "class_graph":
        print(f"graph-precompute: class graph -> {build_class_graph(cfg)}")
    elif cfg.task == "neighbours":
        graph = build_neighbours(cfg)
        print(f"graph-precompute: caption-neighbour graph ({graph.index}, recall "
              f"{graph.recall:.3f} against exact search on a sample) -> {graph.path}")
    else:
        print(describe(cfg))


if __name__ == "__main__":
    main()
