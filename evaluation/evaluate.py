"""``evaluate``: weighted kNN, linear probe and diagnostics of an encoder (issue #6).

    evaluate --config launch/configs/demo.yaml eval.model=models:/digits-encoder/1
    torchrun --nproc_per_node 2 -m evaluation.evaluate --config ... --promote champion

Features are extracted by every rank (each sample once); rank 0 computes the numbers,
writes ``results.json``, PNG plots and ``report.md`` to ``eval.output`` (default
``<run_dir>/eval``) and logs them to MLflow as a child run of the training run.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from evaluation.diagnostics import (
    alignment_uniformity,
    class_geometry,
    knn_mutual_information,
    learned_similarity,
    rank_correlation,
    target_noise_margin,
)
from evaluation.features import Features, extract
from evaluation.knn import build_index, knn_accuracy
from evaluation.load import ModelRef, load_model
from evaluation.probe import linear_probe
from evaluation.report import plot_knn, plot_margin, plot_similarity, write_json, write_markdown
from evaluation.tracking import log_evaluation, upload_outputs
from pretrain.cli import parse_run_args
from pretrain.run_config import RunConfig
from pretrain.runtime import init_runtime, shutdown
from pretrain.tracking import tracking_uri

log = logging.getLogger("evaluate")


def class_graph(config: RunConfig) -> np.ndarray | None:
    path = Path(config.objective.class_graph)
    if not path.is_file():
        return None
    from data_pipeline.graph.class_graph import load_class_graph

    return load_class_graph(path)[0]


def diagnostics(space: str, train: Features, test: Features, config: RunConfig,
                out: Path, plots: list[str]) -> dict[str, Any]:
    cfg = config.eval
    bank, queries = getattr(train, space), getattr(test, space)
    margin = target_noise_margin(bank, train.labels, queries, test.labels)
    plot_margin(margin.pop("same"), margin.pop("other"), margin["margin"],
                out / f"margin_{space}.png")
    geometry = class_geometry(queries, test.labels)
    geometry.pop("per_class_variance")
    geometry.pop("class_mean_cosine_matrix")
    result = {**margin, **geometry,
              **alignment_uniformity(queries, test.labels, cfg.max_diagnostic_samples),
              "mutual_information": knn_mutual_information(
                  queries, test.labels, cfg.mi_neighbours, cfg.max_diagnostic_samples)}
    target = class_graph(config)
    correlations = []
    for number, group in enumerate(cfg.class_groups):
        learned = learned_similarity(queries, test.labels, group, cfg.samples_per_class)
        sub = target[np.ix_(group, group)] if target is not None else None
        corr = rank_correlation(learned, sub) if sub is not None else float("nan")
        correlations.append(corr)
        names = [test.class_names[c] if c < len(test.class_names) else str(c) for c in group]
        plot_similarity(learned, sub, names, corr, out / f"similarity_{space}_{number}.png")
        plots.append(f"similarity_{space}_{number}.png")
    result["rank_correlation"] = float(np.nanmean(correlations)) if target is not None \
        else None
    plots.append(f"margin_{space}.png")
    return result


def knn_results(train: Features, test: Features, config: RunConfig, out: Path,
                results: dict[str, Any]) -> None:
    cfg = config.eval
    num_classes = max(len(train.class_names), int(train.labels.max()) + 1)
    results["knn"] = {}
    for space in ("backbone", "projector"):
        bank = getattr(train, space)
        path = out / f"index_{space}_{cfg.index}" if cfg.save_index else None
        index = build_index(bank, cfg.index, cfg.ivf_lists, cfg.ivf_probe, path)
        if path is not None:
            index.save(path)
        accuracy, _ = knn_accuracy(index, train.labels, getattr(test, space), test.labels,
                                   cfg.ks, cfg.knn_temperature, num_classes)
        if cfg.index == "ivf":  # the approximate index's accuracy against exact search
            exact, _ = knn_accuracy(build_index(bank, "exact"), train.labels,
                                    getattr(test, space), test.labels, cfg.ks,
                                    cfg.knn_temperature, num_classes)
            if space == "backbone":
                k = f"k{cfg.promote_k}"
                results["ivf"] = {"k": cfg.promote_k, "top1": accuracy[k]["top1"],
                                  "exact_top1": exact[k]["top1"]}
        results["knn"][space] = accuracy
    results["linear_probe"] = linear_probe(train.backbone, train.labels, test.backbone,
                                           test.labels, num_classes, cfg.probe_epochs,
                                           cfg.probe_lr)


def evaluate_features(train: Features, test: Features, config: RunConfig, ref: ModelRef,
                      out: Path) -> dict[str, Any]:
    results: dict[str, Any] = {"model": vars(ref), "train_shards": config.eval.train_shards,
                               "test_shards": config.eval.test_shards,
                               "samples": {"train": len(train.keys), "test": len(test.keys)}}
    knn_results(train, test, config, out, results)
    plots = ["knn_accuracy.png"]
    plot_knn(results, out / "knn_accuracy.png")
    results["diagnostics"] = {space: diagnostics(space, train, test, config, out, plots)
                              for space in ("backbone", "projector")}
    results["plots"] = plots
    return results


def run(config: RunConfig, promote_alias: str | None = None) -> dict[str, Any] | None:
    rt = init_runtime(config.train.device, config.engine.backend)
    run_dir = Path(config.output_dir) / config.name
    out = Path(config.eval.output) if config.eval.output else run_dir / "eval"
    uri = tracking_uri(config.tracking, run_dir)
    try:
        model, ref = load_model(config.eval.model, run_dir, uri)
        train = extract(model, config.data, config.eval.train_shards, rt.device, rt.rank,
                        rt.world)
        test = extract(model, config.data, config.eval.test_shards, rt.device, rt.rank,
                       rt.world)
        if not rt.is_main:
            return None
        out.mkdir(parents=True, exist_ok=True)
        results = evaluate_features(train, test, config, ref, out)
        tracked = (log_evaluation(uri, config, ref, results, promote_alias)
                   if config.tracking.enabled else None)
        write_json(results, out / "results.json")
        write_markdown(results, out / "report.md")
        if tracked is not None:
            upload_outputs(*tracked, out)
        log.info("evaluation written to %s:\n%s", out, (out / "report.md").read_text())
        return results
    finally:
        shutdown()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--promote", metavar="ALIAS", help="set this registry alias on the "
                        "evaluated model version if its kNN top-1 beats the alias holder")


def main(argv: list[str] | None = None) -> None:
    config, args = parse_run_args("evaluate", __doc__, argv, add_arguments)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s: "
                                                   "%(message)s")
    torch.manual_seed(config.seed)
    run(config, args.promote)


if __name__ == "__main__":
    main()
