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
from data_pipeline.graph.config import GraphConfig
from data_pipeline.graph.tasks import task_spec


def main(argv: Sequence[str] | None = None) -> None:
    config, _ = parse_run("graph-precompute", __doc__, argv)
    with reported_faults("graph-precompute"):
        run(config.graph)


def run(cfg: GraphConfig) -> None:
    """The configured task (``data_pipeline/graph/tasks.py``); prints its summary line."""
    line = task_spec(cfg.task).run(cfg)
    if line:
        print(line)


if __name__ == "__main__":
    main()
