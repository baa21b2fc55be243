"""Evaluation results to MLflow: a child run of the training run (``mlflow.parentRunId``)
with every number as a metric and the plots, JSON and report as artifacts; optional
registry promotion. Saved kNN indexes (``INDEX_DIR``, as large as the bank) stay out of
MLflow: they are kept next to the report, reused by the next evaluation of the same model
and bank, and ``results.json`` records their paths."""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from core.config import flatten
from core.errors import first_line
from evaluation.config import EvalConfig
from evaluation.report import scalars
from pretrain.run.tracking import experiment_id, quiet_store_errors
from registry.evaluation_record import EvaluationRecord, keep_evaluation
from registry.promote import promote, record_score
from registry.versions import ModelRef

log = logging.getLogger(__name__)
INDEX_DIR = "indexes"  # under the evaluation's output folder


def log_evaluation(uri: str, cfg: EvalConfig, experiment: str, run_name: str, ref: ModelRef,
                   results: dict[str, Any], promote_alias: str | None) -> tuple[Any, str]:
    """Create the evaluation run, log the numbers, promote; returns (client, run id) for
    :func:`upload_outputs` once the files are written."""
    import mlflow
    from mlflow.entities import Metric, Param

    quiet_store_errors()
    client = mlflow.MlflowClient(uri, registry_uri=uri)
    experiment = (client.get_run(ref.run_id).info.experiment_id if ref.run_id is not None
                  else experiment_id(client, experiment))
    tags = {"evaluated_model": ref.source}
    if ref.run_id is not None:
        tags["mlflow.parentRunId"] = ref.run_id
    run = client.create_run(experiment, run_name=f"eval-{run_name}", tags=tags)
    score = results["knn"]["backbone"][f"k{cfg.promote_k}"]["top1"]
    if promote_alias:
        if ref.name is None:
            raise ValueError("--promote needs a registry model: eval.model=models:/name/N")
        results["promotion"] = promote(client, ref.name, ref.version, promote_alias, score)
        log.info("promotion: %s", results["promotion"])
    elif ref.name is not None:
        record_score(client, ref.name, ref.version, score)
    if ref.name is not None:
        keep_evaluation(client, ref, evaluation_record(results, cfg, run.info.run_id))
    params = {k: str(v)[:6000] for k, v in flatten(cfg).items()}
    metrics = [Metric(k.replace("@", "_"), v, 0, 0) for k, v in scalars(results).items()]
    client.log_batch(run.info.run_id, metrics=metrics,
                     params=[Param(f"eval.{k}", v) for k, v in params.items()])
    results["mlflow_run_id"] = run.info.run_id
    return client, run.info.run_id


def evaluation_record(results: dict[str, Any], cfg: EvalConfig, run_id: str
                      ) -> EvaluationRecord:
    """The figures an exported card carries (``registry/evaluation_record.py``)."""
    k = f"k{cfg.promote_k}"
    floor = results.get("untrained")
    return EvaluationRecord(
        date=datetime.now(UTC).strftime("%Y-%m-%d"), run_id=run_id,
        test_shards=str(cfg.test_shards), test_samples=int(results["samples"]["test"]),
        train_samples=int(results["samples"]["train"]), k=cfg.promote_k,
        knn_top1=float(results["knn"]["backbone"][k]["top1"]),
        probe_top1=float(results["linear_probe"]["top1"]),
        untrained_knn_top1=float(floor["knn"]["backbone"][k]["top1"]) if floor else None,
        untrained_probe_top1=float(floor["linear_probe"]["top1"]) if floor else None)


def upload_outputs(client: Any, run_id: str, out: Path) -> None:
    """Log the evaluation's files (not its saved indexes) and close its run."""
    for entry in sorted(out.iterdir()):
        if entry.name == INDEX_DIR:
            continue
        if entry.is_dir():
            client.log_artifacts(run_id, str(entry), artifact_path=entry.name)
        else:
            client.log_artifact(run_id, str(entry))
    client.set_terminated(run_id)


def end_failed(client: Any, run_id: str) -> None:
    """Mark the evaluation run FAILED after a fault; a store that fails now is named in a
    warning, the fault itself is the one reported."""
    try:
        client.set_terminated(run_id, "FAILED")
    except Exception as err:
        log.warning("evaluation: MLflow run %s not marked FAILED (%s)", run_id,
                    first_line(err, 300))
