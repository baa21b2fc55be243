"""Registered versions in the MLflow model registry: registration (the files of
:mod:`registry.package`, logged as an MLflow "model from code" that the serving layer
provides), resolution of ``runs:/`` and ``models:/`` URIs, and verification of every
downloaded file against the SHA-256 digests kept in the tracking store (the model version's
tag ``artifact_sha256``, the run's tag ``encoder.artifact_sha256``).

Our loaders (``evaluate``, :func:`download_verified`) never run the artifact's code: a file
replaced in the artifact store fails by name, and the encoder is rebuilt with the
project's own code from the safetensors weights and the YAML configuration.
"""

from __future__ import annotations

import copy
import json
import tempfile
from dataclasses import dataclass
from importlib.metadata import version as package_version
from pathlib import Path
from typing import Any

import torch
import torchvision
from torch import Tensor, nn

from core.errors import first_line
from pretrain.model.text_tower import TextTower
from registry.package import (
    EmbeddingModel,
    ModelCard,
    RegistryError,
    digest_tree,
    load_package,
    verify_tree,
    write_package,
)

ARTIFACT = "encoder"  # the logged model's name under its run (runs:/<id>/encoder)
VERSION_TAG = "artifact_sha256"  # model version tag: {relative path: sha256}
RUN_TAG = "encoder.artifact_sha256"  # the same record on the run


@dataclass
class ModelRef:
    """Where a model came from: its source, and registry/run identity when known."""

    source: str
    run_id: str | None = None
    name: str | None = None
    version: str | None = None
    storage: str | None = None  # the files' location (the logged model's URI)


@dataclass(frozen=True)
class ServedForm:
    """How a registered version is served: the model-from-code file MLflow stores and runs
    (a plain Python file, no pickled object) and its MLflow signature; the serving layer
    gives it (``serving.inputs.served_form``)."""

    code: Path
    signature: Any


def log_encoder(uri: str, run_id: str, encoder: nn.Module, registered_model: str,
                config_yaml: str, card: ModelCard, served: ServedForm,
                text: TextTower | None = None, class_embeddings: Tensor | None = None) -> str:
    """Log ``encoder`` (and the ``text`` tower of clip or siglip, the learned
    ``class_embeddings`` [C, P] of projnce) under the run as the model from code
    ``served``, register it with the model card as the version's description, and record
    every file's digest in the tracking store; returns the new version."""
    import mlflow

    model = EmbeddingModel(copy.deepcopy(encoder).float().cpu().eval(),
                           None if text is None else copy.deepcopy(text).float().cpu().eval(),
                           None if class_embeddings is None
                           else class_embeddings.detach().float().cpu().clone())
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    requirements = [f"torch=={torch.__version__.split('+')[0]}",
                    f"torchvision=={torchvision.__version__.split('+')[0]}",
                    f"safetensors=={package_version('safetensors')}",
                    f"timm=={package_version('timm')}",  # model.backbone=timm:<name>
                    f"contrastive-pretrain=={package_version('contrastive-pretrain')}"]
    with tempfile.TemporaryDirectory() as tmp:
        artifacts = write_package(Path(tmp), model, config_yaml, card)
        with mlflow.start_run(run_id=run_id, log_system_metrics=False):
            info = mlflow.pyfunc.log_model(name=ARTIFACT, python_model=str(served.code),
                                           artifacts=artifacts, signature=served.signature,
                                           pip_requirements=requirements,
                                           registered_model_name=registered_model)
    version = str(info.registered_model_version)
    with tempfile.TemporaryDirectory() as tmp:
        stored = Path(mlflow.artifacts.download_artifacts(info.model_uri, dst_path=tmp))
        record = json.dumps(digest_tree(stored), sort_keys=True)
    client = mlflow.MlflowClient(uri, registry_uri=uri)
    client.update_model_version(registered_model, version, description=card.markdown())
    client.set_model_version_tag(registered_model, version, VERSION_TAG, record)
    client.set_tag(run_id, RUN_TAG, record)
    return version


def resolve(source: str, uri: str, key: str = "eval.model") -> tuple[ModelRef, str | None]:
    """Registry identity of ``runs:/<id>/encoder``, ``models:/name/<version|latest>`` or
    ``models:/name@alias``, and its artifact digest record (None if it has none);
    messages name the option ``key`` that gave ``source``."""
    import mlflow
    from mlflow.exceptions import MlflowException

    client = mlflow.MlflowClient(uri, registry_uri=uri)
    try:
        if source.startswith("runs:/"):
            run_id = source[len("runs:/"):].split("/")[0]
            return ModelRef(source, run_id=run_id), client.get_run(run_id).data.tags.get(RUN_TAG)
        if not source.startswith("models:/"):
            raise RegistryError(f"{key}={source}: not a runs:/ or models:/ URI")
        spec = source[len("models:/"):]
        if "@" in spec:
            name, alias = spec.split("@", 1)
            version = client.get_model_version_by_alias(name, alias)
        else:
            name, number = spec.rsplit("/", 1) if "/" in spec else (spec, "")
            if number == "latest":
                versions = client.search_model_versions(f"name='{name}'")
                if not versions:
                    raise RegistryError(f"{key}={source}: registered model {name!r} has "
                                        f"no versions in {uri}")
                number = str(max(int(v.version) for v in versions))
            version = client.get_model_version(name, number)
    except MlflowException as err:
        raise RegistryError(f"{key}={source}: not found in {uri} "
                            f"({first_line(err.message, 160)})") from None
    return (ModelRef(source, version.run_id, name, str(version.version), version.source),
            version.tags.get(VERSION_TAG))


def fetch_verified(source: str, uri: str, record: str | None, directory: Path,
                   label: str | None = None) -> Path:
    """Download the logged model ``source`` (``runs:/<id>/encoder`` or a logged model's
    ``models:/m-<id>``) into ``directory`` and verify every file, its code included,
    against ``record`` (the JSON digest tag); returns the local copy. Nothing in it has
    run. Messages name the model as ``label`` (default ``source``)."""
    import mlflow

    label = label or source
    if not record:
        raise RegistryError(
            f"{label}: no artifact digests registered with it (tag {VERSION_TAG}); it was "
            "logged by another tool or an older version, whose files are never loaded: "
            "register it again from its training checkpoint")
    try:
        expected = json.loads(record)
    except json.JSONDecodeError as err:
        raise RegistryError(f"{label}: tag {VERSION_TAG} is not valid JSON ({err})") from None
    local = Path(mlflow.artifacts.download_artifacts(source, dst_path=str(directory),
                                                     tracking_uri=uri))
    verify_tree(local, expected, label)
    return local


def download_verified(source: str, uri: str, record: str | None, directory: Path,
                      label: str | None = None) -> tuple[EmbeddingModel, dict[str, Any]]:
    """:func:`fetch_verified`, then rebuild the encoder with our code: (model, the run's
    configuration tree); nothing is unpickled and none of the artifact's code runs."""
    local = fetch_verified(source, uri, record, directory, label)
    try:
        return load_package(local)
    except Exception as err:  # a verified file we cannot read: say which version
        raise RegistryError(f"{label or source}: its files verify but do not load as an "
                            f"encoder ({first_line(err)})") from None


def add_card_line(client: Any, ref: ModelRef, line: str) -> None:
    """Append ``line`` to the model card (description) of the registered version ``ref``,
    once: a line the card already holds is not added again."""
    card = client.get_model_version(ref.name, ref.version).description or ""
    if line not in card:
        client.update_model_version(ref.name, ref.version,
                                    description=f"{card}\n\n{line}".lstrip())
