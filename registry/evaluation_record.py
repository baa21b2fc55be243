"""A registered version's evaluation, as ``evaluate`` records it and exported cards show it.

``evaluate`` on ``models:/NAME/V`` keeps its headline figures on the version as the tag
``evaluation`` (JSON of :class:`EvaluationRecord`); ``export`` reads that tag back, checks
it like any registry input, and writes the figures into the model card (a table and the
Hugging Face ``model-index`` block) and the ONNX metadata. A version never evaluated, or
an encoder exported from a checkpoint, says so in one line."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from typing import Any

from registry.package import RegistryError
from registry.versions import ModelRef

EVALUATION_TAG = "evaluation"  # model version tag: the latest evaluation's figures
MAX_TAG_CHARS = 4000


@dataclass(frozen=True)
class EvaluationRecord:
    """The figures a card carries: backbone kNN top-1 at ``k`` and the linear probe's
    top-1 on ``test_shards`` (``test_samples`` images, the bank ``train_samples``), with an
    untrained copy's figures beside them when the evaluation measured that floor."""

    date: str  # UTC, YYYY-MM-DD
    run_id: str  # the evaluation's MLflow run
    test_shards: str
    test_samples: int
    train_samples: int
    k: int
    knn_top1: float
    probe_top1: float
    untrained_knn_top1: float | None = None
    untrained_probe_top1: float | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str, where: str) -> EvaluationRecord:
        """The record in ``text``; :class:`RegistryError` naming ``where`` and the field
        for anything else (a registry tag is outside input)."""
        if len(text) > MAX_TAG_CHARS:
            raise RegistryError(f"{where}: the {EVALUATION_TAG} tag holds {len(text)} "
                                f"characters, more than {MAX_TAG_CHARS}")
        try:
            value = json.loads(text)
        except ValueError as err:
            raise RegistryError(f"{where}: the {EVALUATION_TAG} tag is not JSON ({err})") \
                from err
        if not isinstance(value, dict):
            raise RegistryError(f"{where}: the {EVALUATION_TAG} tag is not a JSON object")
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(value) - set(known))
        if unknown:
            raise RegistryError(f"{where}: the {EVALUATION_TAG} tag has unknown field "
                                f"{unknown[0]!r}")
        for name, field in known.items():
            _check_field(value, name, str(field.type), where)
        return cls(**value)


def _check_field(value: dict[str, Any], name: str, kind: str, where: str) -> None:
    optional = "None" in kind
    item = value.get(name)
    if item is None:
        if optional:
            return
        raise RegistryError(f"{where}: the {EVALUATION_TAG} tag has no {name}")
    if kind.startswith("str"):
        ok = isinstance(item, str) and len(item) <= 500
    elif kind.startswith("int"):
        ok = isinstance(item, int) and not isinstance(item, bool) and item >= 0
    else:  # an accuracy
        ok = isinstance(item, (int, float)) and not isinstance(item, bool) \
            and math.isfinite(item) and 0 <= item <= 1
    if not ok:
        raise RegistryError(f"{where}: the {EVALUATION_TAG} tag's {name} is not a valid "
                            f"{kind.split(' ')[0]}: {str(item)[:40]!r}")


def read_evaluation(ref: ModelRef, uri: str) -> EvaluationRecord | None:
    """The evaluation recorded on the registered version ``ref`` (None: never evaluated,
    or not a registered version)."""
    if not (ref.name and ref.version):
        return None
    from mlflow import MlflowClient

    tags = MlflowClient(uri, registry_uri=uri).get_model_version(ref.name, ref.version).tags
    text = tags.get(EVALUATION_TAG)
    where = f"models:/{ref.name}/{ref.version}"
    return None if text is None else EvaluationRecord.from_json(text, where)


def keep_evaluation(client: Any, ref: ModelRef, record: EvaluationRecord) -> None:
    """Keep ``record`` on the registered version ``ref`` as its tag ``evaluation``."""
    client.set_model_version_tag(ref.name, ref.version, EVALUATION_TAG, record.to_json())


def unevaluated_line(ref_registered: bool) -> str:
    """The one line a card carries in place of figures."""
    if ref_registered:
        return ("Not evaluated: this registered version has no evaluation on record (run "
                "`evaluate` on it, then export again).")
    return ("Not evaluated: exported from a checkpoint or run, not a registered version; "
            "evaluations are recorded on registered versions.")


def _percent(value: float | None) -> str:
    return "not measured" if value is None else f"{100 * value:.1f}%"


def card_table(record: EvaluationRecord) -> list[str]:
    """The card's evaluation section: trained against untrained, with the date and set."""
    return [f"Evaluated {record.date} on `{record.test_shards}` ({record.test_samples} test "
            f"images, a kNN bank of {record.train_samples}; evaluation run "
            f"`{record.run_id}`).", "",
            "| measure | this encoder | untrained copy |", "|---|---|---|",
            f"| backbone kNN top-1 (k={record.k}) | {_percent(record.knn_top1)} | "
            f"{_percent(record.untrained_knn_top1)} |",
            f"| linear probe top-1 | {_percent(record.probe_top1)} | "
            f"{_percent(record.untrained_probe_top1)} |"]


def model_index(record: EvaluationRecord, title: str) -> list[dict[str, Any]]:
    """The Hugging Face card's ``model-index`` block: one result per measure."""
    dataset = {"name": record.test_shards, "type": record.test_shards}
    measures = [(f"kNN top-1 (backbone, k={record.k})", record.knn_top1),
                ("linear probe top-1", record.probe_top1),
                (f"untrained kNN top-1 (backbone, k={record.k})",
                 record.untrained_knn_top1),
                ("untrained linear probe top-1", record.untrained_probe_top1)]
    metrics = [{"type": "accuracy", "name": name, "value": round(float(value), 6)}
               for name, value in measures if value is not None]
    return [{"name": title, "results": [{
        "task": {"type": "image-classification", "name": "image classification"},
        "dataset": dataset, "metrics": metrics}]}]
