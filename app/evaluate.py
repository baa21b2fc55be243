"""``evaluate``: weighted kNN, linear probe and diagnostics of an encoder.

    evaluate --config launch/configs/demo.yaml eval.model=models:/digits-encoder/1
    torchrun --nproc_per_node 2 -m app.evaluate --config ... --promote champion
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from app.run_config import RunConfig, parse_run
from core.cli import reported_faults
from core.runtime import init_runtime, shutdown
from data_pipeline.graph.class_graph import load_class_graph
from evaluation.evaluate import EvalContext, evaluate


def target_graph(config: RunConfig) -> np.ndarray | None:
    """The class graph to compare the learned similarity with: ``eval.class_graph``, else
    the one the run's objective trained towards."""
    name = config.eval.class_graph or config.objective.class_graph_path
    return load_class_graph(Path(name))[0] if name and Path(name).is_file() else None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--promote", metavar="ALIAS", help="set this registry alias on the "
                        "evaluated model version if its kNN top-1 beats the alias holder")


def run(config: RunConfig, promote_alias: str | None = None) -> dict | None:
    rt = init_runtime(config.train.device, config.engine.backend,
                      collective_timeout_s=config.engine.collective_timeout)
    context = EvalContext(Path(config.output_dir) / config.name, config.name, config.tracking,
                          target_graph(config), config.seed)
    try:
        return evaluate(config.eval, config.data, context, rt, promote_alias)
    finally:
        shutdown()


def main(argv: Sequence[str] | None = None) -> None:
    config, args = parse_run("evaluate", __doc__, argv, add_arguments)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s: "
                                                   "%(message)s")
    torch.manual_seed(config.seed)
    with reported_faults("evaluate"):
        run(config, args.promote)


if __name__ == "__main__":
    main()
