"""Evaluation of an encoder: weighted kNN, linear probe and diagnostics (``evaluate``);
for models with CLIP's text tower also image-text retrieval and zero-shot classification.

Features are extracted by every rank (each sample once); rank 0 computes the numbers,
writes ``results.json``, PNG plots and ``report.md`` to ``eval.output`` (default
``<run_dir>/eval``) and logs them to MLflow as a child run of the training run.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from core.collectives import all_ranks_agree
from core.errors import RunError, full_disk_stops
from core.runtime import Runtime
from data_pipeline.config import DataConfig
from data_pipeline.shards import ShardSet
from evaluation.bank import Bank
from evaluation.config import EvalConfig
from evaluation.diagnostics import (
    alignment_uniformity,
    class_geometry,
    knn_mutual_information,
    learned_similarity,
    rank_correlation,
    target_noise_margin,
)
from evaluation.features import Features, extract, extract_bank
from evaluation.identity import bank_digest, index_key, model_digest
from evaluation.knn import build_index, knn_accuracy
from evaluation.load import load_model, untrained_copy
from evaluation.probe import linear_probe
from evaluation.report import plot_knn, plot_margin, plot_similarity, write_json, write_markdown
from evaluation.retrieval import caption_evaluation, class_embedding_classifier, no_captions
from evaluation.tracking import INDEX_DIR, end_failed, log_evaluation, upload_outputs
from pretrain.run.tracking import TrackingConfig, tracking_uri
from registry.versions import ModelRef

log = logging.getLogger("evaluate")
AGAIN = "the model and its checkpoints are untouched and the same command evaluates again"
MAX_HEATMAP_CLASSES = 50  # eval.class_groups = []: one group of all classes up to this many


@dataclass
class EvalContext:
    """Where an evaluation reads its model and writes its results."""

    run_dir: Path  # the training run's directory (checkpoints, MLflow store)
    run_name: str  # names the evaluation's MLflow run
    tracking: TrackingConfig
    target_graph: np.ndarray | None = None  # [C, C] class similarity to compare with
    seed: int = 0  # initialises the untrained encoder of eval.compare_untrained


def class_groups(cfg: EvalConfig, num_classes: int) -> list[list[int]]:
    if cfg.class_groups:
        return cfg.class_groups
    return [list(range(num_classes))] if 1 < num_classes <= MAX_HEATMAP_CLASSES else []


def diagnostics(space: str, train: Bank | Features, test: Features, cfg: EvalConfig,
                target: np.ndarray | None, out: Path, plots: list[str]) -> dict[str, Any]:
    bank, queries = getattr(train, space), getattr(test, space)
    budget = cfg.block_bytes
    margin = target_noise_margin(bank, train.labels, queries, test.labels, budget)
    plot_margin(margin.pop("same"), margin.pop("other"), margin["margin"],
                out / f"margin_{space}.png")
    geometry = class_geometry(queries, test.labels)
    geometry.pop("per_class_variance")
    geometry.pop("class_mean_cosine_matrix")
    result = {**margin, **geometry,
              **alignment_uniformity(queries, test.labels, cfg.max_diagnostic_samples,
                                     block_bytes=budget),
              "mutual_information": knn_mutual_information(
                  queries, test.labels, cfg.mi_neighbours, cfg.max_diagnostic_samples,
                  block_bytes=budget),
              "diagnostic_samples": min(len(queries), cfg.max_diagnostic_samples)}
    correlations = []
    groups = class_groups(cfg, max(len(test.class_names), int(test.labels.max()) + 1))
    for number, group in enumerate(groups):
        learned = learned_similarity(queries, test.labels, group, cfg.samples_per_class)
        sub = target[np.ix_(group, group)] if target is not None else None
        corr = rank_correlation(learned, sub) if sub is not None else float("nan")
        correlations.append(corr)
        names = [test.class_names[c] if c < len(test.class_names) else str(c) for c in group]
        plot_similarity(learned, sub, names, corr, out / f"similarity_{space}_{number}.png")
        plots.append(f"similarity_{space}_{number}.png")
    result["rank_correlation"] = (float(np.nanmean(correlations))
                                  if target is not None and correlations else None)
    plots.append(f"margin_{space}.png")
    return result


def knn_results(train: Bank | Features, test: Features, cfg: EvalConfig, out: Path,
                results: dict[str, Any], identity: dict[str, str] | None = None,
                device: torch.device | None = None) -> None:
    """kNN in both spaces and the linear probe (trained on ``device``, default the CPU)
    into ``results``; with ``identity`` (model and bank digests) and ``cfg.save_index`` an
    IVF index is saved under a name keyed by them (under ``out/indexes``, kept out of
    MLflow: the results record the path), and reused only by an evaluation of the same
    model on the same bank (exact search reads the bank itself: nothing to save)."""
    num_classes = max(len(train.class_names), int(train.labels.max()) + 1)
    budget = cfg.block_bytes
    results["knn"] = {}
    settings = {"index": cfg.index, "ivf_lists": cfg.ivf_lists, "ivf_probe": cfg.ivf_probe}
    for space in ("backbone", "projector"):
        bank = getattr(train, space)
        path = None
        if cfg.save_index and identity is not None and cfg.index == "ivf":
            key = index_key(identity["model_sha256"], identity["bank_sha256"], space, settings)
            path = out / INDEX_DIR / f"index_{space}_{cfg.index}_{key}"
            path.parent.mkdir(parents=True, exist_ok=True)
        index = build_index(bank, cfg.index, cfg.ivf_lists, cfg.ivf_probe, path, budget,
                            cfg.bank_block_bytes)
        if path is not None:
            if not index.loaded:
                index.save(path)
            results.setdefault("indexes", {})[space] = str(path)
        accuracy, _ = knn_accuracy(index, train.labels, getattr(test, space), test.labels,
                                   cfg.ks, cfg.knn_temperature, num_classes, budget)
        if cfg.index == "ivf":  # the approximate index's accuracy against exact search
            exact, _ = knn_accuracy(build_index(bank, "exact", block_bytes=budget,
                                                bank_block_bytes=cfg.bank_block_bytes),
                                    train.labels, getattr(test, space), test.labels, cfg.ks,
                                    cfg.knn_temperature, num_classes, budget)
            if space == "backbone":
                k = f"k{cfg.promote_k}"
                results["ivf"] = {"k": cfg.promote_k, "top1": accuracy[k]["top1"],
                                  "exact_top1": exact[k]["top1"]}
        results["knn"][space] = accuracy
    results["linear_probe"] = linear_probe(train.backbone, train.labels, test.backbone,
                                           test.labels, num_classes, cfg.probe_epochs,
                                           cfg.probe_lr, device=device)


def evaluate_features(train: Bank | Features, test: Features, cfg: EvalConfig,
                      target: np.ndarray | None, ref: ModelRef, out: Path,
                      identity: dict[str, str],
                      device: torch.device | None = None) -> dict[str, Any]:
    results: dict[str, Any] = {"model": vars(ref), "identity": identity,
                               "train_shards": cfg.train_shards,
                               "test_shards": cfg.test_shards,
                               "samples": {"train": len(train.labels), "test": len(test.keys)}}
    knn_results(train, test, cfg, out, results, identity, device)
    plots = ["knn_accuracy.png"]
    plot_knn(results, out / "knn_accuracy.png")
    results["diagnostics"] = {space: diagnostics(space, train, test, cfg, target, out, plots)
                              for space in ("backbone", "projector")}
    results["plots"] = plots
    return results


def require_labels(cfg: EvalConfig) -> None:
    """kNN and the probe need class labels: fail before any work on shards without them."""
    for key in ("train_shards", "test_shards"):
        shards = getattr(cfg, key)
        if not ShardSet.class_names_of(shards):
            raise RunError(f"eval.{key}={shards}: its manifest lists no classes; kNN and the "
                           "linear probe need labelled shards (make-shards with labels)")


def evaluate(cfg: EvalConfig, data: DataConfig, context: EvalContext, rt: Runtime,
             promote_alias: str | None = None) -> dict[str, Any] | None:
    """Evaluate ``cfg.model`` on every rank; rank 0 returns (and writes) the results."""
    out = Path(cfg.output) if cfg.output else context.run_dir / "eval"
    require_labels(cfg)
    data = dataclasses.replace(data, caption_store="")  # images and labels only
    uri = tracking_uri(context.tracking, context.run_dir)
    model, ref = load_model(cfg.model, context.run_dir, uri)
    identity = {"model_sha256": model_digest(model),
                "bank_sha256": bank_digest(cfg.train_shards, data.resolution)}
    test = extract(model, data, cfg.test_shards, rt.device, rt.rank, rt.world)
    retrieval_shards = cfg.retrieval_shards or cfg.test_shards
    retrieval = test
    if model.text is not None:  # shards without captions fail before the bank is read
        if retrieval_shards != cfg.test_shards:
            retrieval = extract(model, data, retrieval_shards, rt.device, rt.rank, rt.world)
        if not all_ranks_agree(retrieval is None or any(retrieval.captions), rt.device):
            raise no_captions(retrieval_shards)
    banks = out / "features"  # every rank writes its share of each bank there
    try:
        with full_disk_stops("the evaluation's output", out, "eval.output", AGAIN):
            train = extract_bank(model, data, cfg.train_shards, rt.device, banks / "bank",
                                 rt.rank, rt.world)
            if cfg.compare_untrained:
                floor = untrained_copy(model, context.seed)
                floor_features = (extract_bank(floor, data, cfg.train_shards, rt.device,
                                               banks / "untrained", rt.rank, rt.world),
                                  extract(floor, data, cfg.test_shards, rt.device, rt.rank,
                                          rt.world))
        if not rt.is_main:
            return None
        with full_disk_stops("the evaluation's output", out, "eval.output", AGAIN):
            results = evaluate_features(train, test, cfg, context.target_graph, ref, out,
                                        identity, rt.device)
            if model.text is not None:
                results.update(caption_evaluation(model, retrieval, test, cfg,
                                                  retrieval_shards, rt.device))
            if model.class_embeddings is not None:
                results["class_embedding_classifier"] = class_embedding_classifier(
                    model.class_embeddings, test)
            if cfg.compare_untrained:
                results["untrained"] = {}
                knn_results(*floor_features, dataclasses.replace(cfg, save_index=False), out,
                            results["untrained"], device=rt.device)
    finally:
        if rt.is_main:  # the banks' files: read by now, or of a failed evaluation
            shutil.rmtree(banks, ignore_errors=True)
    tracked = None
    store_full = partial(full_disk_stops, "to the MLflow tracking store", uri, "tracking.uri",
                         AGAIN)
    if context.tracking.enabled:
        with store_full():
            tracked = log_evaluation(uri, cfg, context.tracking.experiment, context.run_name,
                                     ref, results, promote_alias)
    try:
        with full_disk_stops("the evaluation's output", out, "eval.output", AGAIN):
            write_json(results, out / "results.json")
            write_markdown(results, out / "report.md")
        if tracked is not None:
            with store_full():
                upload_outputs(*tracked, out)
    except BaseException:
        if tracked is not None:
            end_failed(*tracked)
        raise
    log.info("evaluation written to %s:\n%s", out, (out / "report.md").read_text())
    return results
