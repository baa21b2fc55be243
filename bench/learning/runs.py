"""One configuration of the learning benchmark: train it with the real ``pretrain``
command (2 DDP processes over gloo, as the demo trains), then evaluate the encoder and
the untrained encoder it started from."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from app.run_config import RunConfig
from bench.common import write_json
from bench.learning.data import DataSet
from bench.records import invocation, provenance
from core.config import load_config
from data_pipeline.config import DataConfig
from data_pipeline.graph.class_graph import load_class_graph
from evaluation.config import EvalConfig
from evaluation.diagnostics import learned_similarity, rank_correlation
from evaluation.evaluate import evaluate_features
from evaluation.features import extract
from evaluation.identity import bank_digest, model_digest
from evaluation.load import from_checkpoint
from evaluation.retrieval import caption_evaluation, class_embedding_classifier
from pretrain.model.encoder import build_model
from pretrain.objectives.table import objective_spec
from pretrain.run.checkpoint import list_checkpoints
from registry.package import EmbeddingModel
from registry.versions import ModelRef

REPO = Path(__file__).resolve().parents[2]
KS = [1, 5, 10, 20, 50, 100, 200]
SPACES = ("backbone", "projector")


@dataclass(frozen=True)
class Configuration:
    """A recipe, the overrides that make this configuration, and the data it trains on."""

    name: str  # unique, names the run directory
    recipe: str  # launch/configs/... YAML
    data: str  # "cluttered" or "digits"
    overrides: tuple[str, ...] = ()
    seed: int = 0
    tags: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)


def data_overrides(data: DataSet) -> list[str]:
    """Point a recipe at the benchmark's copies of its data."""
    return [f"data.shards={data.train}", f"eval.train_shards={data.train}",
            f"eval.test_shards={data.test}", f"graph.center={str(data.center).lower()}"]


def run_config(conf: Configuration, data: DataSet, root: Path) -> tuple[RunConfig, list[str]]:
    overrides = [f"output_dir={root / 'runs'}", f"name={conf.name}", f"seed={conf.seed}",
                 f"data.seed={conf.seed}", *data_overrides(data), *conf.overrides,
                 "tracking.enabled=false", "train.progress=false", "checkpoint.every=0",
                 "checkpoint.keep=1"]
    config = load_config(RunConfig, REPO / conf.recipe, overrides)
    soft_targets = objective_spec(config.objective.name).soft_targets
    if soft_targets and config.objective.xclr.class_graph:
        overrides.append(f"objective.xclr.class_graph={data.class_graph}")
    if soft_targets and config.data.caption_store:
        overrides.append(f"data.caption_store={data.caption_store}")
    return load_config(RunConfig, REPO / conf.recipe, overrides), overrides


def run_dir_of(conf: Configuration, root: Path) -> Path:
    """Where ``conf``'s run, its log and its ``result.json`` live under ``root``."""
    return root / "runs" / conf.name


def result_path(conf: Configuration, root: Path) -> Path:
    return run_dir_of(conf, root) / "result.json"


def train(conf: Configuration, data: DataSet, root: Path) -> dict[str, Any]:
    """Train with 2 processes; returns the run's last metric row and wall time."""
    _, overrides = run_config(conf, data, root)
    run_dir = run_dir_of(conf, root)
    run_dir.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node", "2", "-m", "app.pretrain", "--config",
               str(REPO / conf.recipe), *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    start = time.perf_counter()
    with open(run_dir / "stdout.log", "w") as log:
        code = subprocess.run(command, cwd=REPO, env=env, stdout=log,
                              stderr=subprocess.STDOUT).returncode
    text = (run_dir / "stdout.log").read_text()
    rows = re.findall(r"INFO: step (\d+) (.*)", text)
    last = dict(item.split("=") for item in rows[-1][1].split()) if rows else {}
    stopped = re.search(r"(training collapsed at step \d+.*?)(?:\n|$)", text)
    return {"returncode": code, "seconds": time.perf_counter() - start,
            "last_row": {k: float(v) for k, v in last.items()},
            "stopped": stopped.group(1) if stopped else None,
            "collapse_warnings": text.count("collapse warning")}


def evaluate(model: EmbeddingModel, config: RunConfig, data: DataSet,
             out: Path) -> dict[str, Any]:
    """kNN (both feature spaces), linear probe and diagnostics on the test shards, with
    the learned class similarity against the class and caption graphs."""
    out.mkdir(parents=True, exist_ok=True)
    loader = DataConfig(shards=str(data.train), batch_size=256, workers=2,
                        resolution=config.data.resolution)
    cpu = torch.device("cpu")
    train_features = extract(model, loader, str(data.train), cpu, progress=False)
    test_features = extract(model, loader, str(data.test), cpu, progress=False)
    graphs = {"class_graph": load_class_graph(data.class_graph)[0]}
    if data.caption_graph is not None:
        graphs["caption_graph"] = load_class_graph(data.caption_graph)[0]
    target = graphs.get("caption_graph", graphs["class_graph"])
    eval_cfg = EvalConfig(train_shards=str(data.train), test_shards=str(data.test), ks=KS,
                          index="exact", save_index=False, probe_epochs=50,
                          zero_shot_templates=config.eval.zero_shot_templates)
    identity = {"model_sha256": model_digest(model),
                "bank_sha256": bank_digest(str(data.train), config.data.resolution)}
    results = evaluate_features(train_features, test_features, eval_cfg, target,
                                ModelRef(str(out)), out, identity)
    if model.text is not None:  # retrieval on the test canvases' captions, zero-shot
        results.update(caption_evaluation(model, test_features, test_features, eval_cfg,
                                          str(data.test), cpu))
    if model.class_embeddings is not None:  # projnce learned: ProjNCE's own classifier
        results["class_embedding_classifier"] = class_embedding_classifier(
            model.class_embeddings, test_features)
    classes = list(range(len(test_features.class_names)))
    results["similarity"] = {}
    for space in SPACES:
        learned = learned_similarity(getattr(test_features, space), test_features.labels,
                                     classes, 100)
        results["similarity"][space] = {
            "learned": learned.tolist(),
            **{f"rank_correlation_{k}": rank_correlation(learned, g) for k, g in graphs.items()}}
    return results


def untrained(conf: Configuration, data: DataSet, root: Path) -> EmbeddingModel:
    """The encoder the run starts from: the same seed, the same construction."""
    config, _ = run_config(conf, data, root)
    torch.manual_seed(config.seed)
    return EmbeddingModel(build_model(config.model, config.objective,
                                      torch.device("cpu")).encoder)


def trained(conf: Configuration, root: Path) -> EmbeddingModel | None:
    checkpoints = list_checkpoints(run_dir_of(conf, root))
    return from_checkpoint(checkpoints[0])[0] if checkpoints else None


def run(conf: Configuration, data: DataSet, root: Path, floor: bool = False) -> dict[str, Any]:
    """Train (unless ``floor``: the untrained encoder) and evaluate; cached in
    ``runs/<name>/result.json``."""
    path = result_path(conf, root)
    if path.is_file():
        return json.loads(path.read_text())
    config, _ = run_config(conf, data, root)
    seen = provenance(invocation())  # the tree the run starts from, not the one it ends in
    result: dict[str, Any] = {"configuration": dataclasses.asdict(conf)}
    if floor:
        model = untrained(conf, data, root)
    else:
        result["training"] = train(conf, data, root)
        model = trained(conf, root)
    if model is not None:
        result["evaluation"] = evaluate(model, config, data, path.parent / "eval")
    write_json(path, result, seen)
    return json.loads(path.read_text())  # as a later report reads it: its provenance too
