"""The encoder in the MLflow model registry, without pickle.

A registered version holds the encoder's weights (``artifacts/encoder.safetensors``), for
``clip`` runs the text tower's (``artifacts/text_tower.safetensors``), for ProjNCE runs with
learned class embeddings those (``artifacts/class_embeddings.safetensors``), the run's resolved
configuration (``artifacts/config.yaml``) and a model card
(``artifacts/model_card.md``), logged as an MLflow "model from code" (``serving.py``, a
plain Python file; see :mod:`serving.pyfunc`) with a tensor signature
[-1, 3, R, R] float32 -> [-1, P] float32. Nothing in it is a pickled object.

Our loaders (``evaluate``, :func:`download_verified`) never run the artifact's code: they
check every file of the version against SHA-256 digests kept in the tracking store (the
model version's tag ``artifact_sha256``, the run's tag ``encoder.artifact_sha256``), so a
file replaced in the artifact store fails by name, then rebuild the encoder with the
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
import yaml
from torch import Tensor, nn

from core.config import from_dict
from core.errors import RunError, first_line
from data_pipeline.manifest import file_sha256
from pretrain.model.encoder import Encoder, ModelConfig
from pretrain.model.text_tower import TextTower

ARTIFACT = "encoder"  # the logged model's name under its run (runs:/<id>/encoder)
VERSION_TAG = "artifact_sha256"  # model version tag: {relative path: sha256}
RUN_TAG = "encoder.artifact_sha256"  # the same record on the run
WEIGHTS, CONFIG, CARD = "encoder.safetensors", "config.yaml", "model_card.md"
TEXT_WEIGHTS = "text_tower.safetensors"  # clip runs only
CLASS_EMBEDDINGS = "class_embeddings.safetensors"  # projnce learned runs only
PYFUNC = Path(__file__).with_name("pyfunc.py")  # the model-from-code file MLflow stores


@dataclass
class ModelRef:
    """Where a model came from: its source, and registry/run identity when known."""

    source: str
    run_id: str | None = None
    name: str | None = None
    version: str | None = None
    storage: str | None = None  # the files' location (the logged model's URI)


class RegistryError(RunError):
    """A registered model that our loaders refuse: missing, unverifiable or altered."""


class EmbeddingModel(nn.Module):
    """The backbone plus projector; ``forward(images [B, 3, R, R]) -> [B, P]``,
    ``features(images) -> [B, F]`` gives the backbone output for evaluation. ``text`` is
    CLIP's text tower (token ids [B, L], mask [B, L] -> [B, P]) when the run trained one;
    ``class_embeddings`` [C, P] ProjNCE's learned class embeddings when the run learned them
    (a buffer: evaluated, never trained here)."""

    def __init__(self, encoder: nn.Module, text: TextTower | None = None,
                 class_embeddings: Tensor | None = None) -> None:
        super().__init__()
        self.encoder = encoder
        self.text = text
        self.class_embeddings: Tensor | None
        self.register_buffer("class_embeddings", class_embeddings)

    def forward(self, images: Tensor) -> Tensor:
        return self.encoder(images)[1]

    def features(self, images: Tensor) -> Tensor:
        return self.encoder(images)[0]


@dataclass
class ModelCard:
    """What a registered version is: written next to its weights as Markdown."""

    name: str
    objective: dict[str, Any]
    data: dict[str, Any]
    training: dict[str, Any]
    knn: dict[str, float]

    def markdown(self) -> str:
        def table(rows: dict[str, Any]) -> list[str]:
            return ["| key | value |", "|---|---|",
                    *(f"| {k} | {v} |" for k, v in rows.items())]

        knn = table(self.knn) if self.knn else [
            "Not measured during training (train.knn_every = 0); `evaluate` records its "
            "numbers on the evaluation run and the version's tag `knn_top1`."]
        return "\n".join([f"# {self.name}", "", "Encoder (backbone + projector) trained by "
                          "contrastive-pretrain; weights in safetensors, configuration in "
                          "config.yaml.", "", "## Objective", *table(self.objective), "",
                          "## Data", *table(self.data), "", "## Training",
                          *table(self.training), "", "## kNN monitor (top-1)", *knn, ""])


def _save_tensors(state: dict[str, Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    state = {k: v.detach().float().cpu().contiguous() if v.is_floating_point()
             else v.detach().cpu().contiguous() for k, v in state.items()}
    save_file(state, str(path), metadata={"format": "pt"})


def write_package(directory: Path, model: EmbeddingModel, config_yaml: str,
                  card: ModelCard) -> dict[str, str]:
    """Write weights (the text tower's too, when there is one), configuration and card
    into ``directory``; returns MLflow's ``artifacts`` mapping (name -> local path)."""
    _save_tensors(model.encoder.state_dict(), directory / WEIGHTS)
    names = [WEIGHTS, CONFIG, CARD]
    if model.text is not None:
        _save_tensors(model.text.state_dict(), directory / TEXT_WEIGHTS)
        names.append(TEXT_WEIGHTS)
    if model.class_embeddings is not None:
        _save_tensors({"class_embeddings": model.class_embeddings},
                      directory / CLASS_EMBEDDINGS)
        names.append(CLASS_EMBEDDINGS)
    (directory / CONFIG).write_text(config_yaml)
    (directory / CARD).write_text(card.markdown())
    return {name.split(".")[0]: str(directory / name) for name in names}


def digest_tree(root: Path) -> dict[str, str]:
    """{path relative to ``root``: SHA-256 hex} of every file under ``root``."""
    return {path.relative_to(root).as_posix(): file_sha256(path)
            for path in sorted(p for p in root.rglob("*") if p.is_file())}


def verify_tree(root: Path, expected: dict[str, str], source: str) -> None:
    """Raise :class:`RegistryError` naming the first file of ``root`` that is missing,
    unexpected or differs from its registered digest."""
    found = digest_tree(root)
    for name in sorted(set(found) | set(expected)):
        if name not in found:
            raise RegistryError(f"{source}: file {name} is missing from the artifact store")
        if name not in expected:
            raise RegistryError(f"{source}: file {name} was not registered with this version; "
                                "refusing to load it (the artifact store was changed)")
        if found[name] != expected[name]:
            raise RegistryError(f"{source}: file {name} does not match its registered SHA-256 "
                                "digest; refusing to load it (the artifact store was changed)")


def load_package(root: Path) -> tuple[EmbeddingModel, dict[str, Any]]:
    """Rebuild the encoder from a verified package directory (the logged model's root or
    its ``artifacts/``): (model in eval mode, the run's configuration tree)."""
    from safetensors.torch import load_file

    folder = root / "artifacts" if (root / "artifacts").is_dir() else root
    tree = yaml.safe_load((folder / CONFIG).read_text()) or {}
    cfg = from_dict(ModelConfig, tree.get("model", {}), prefix="model.")
    encoder = Encoder(cfg)
    encoder.load_state_dict(load_file(str(folder / WEIGHTS)))
    text = None
    if (folder / TEXT_WEIGHTS).is_file():
        text = TextTower(cfg.text, cfg.projector_dim)
        text.load_state_dict(load_file(str(folder / TEXT_WEIGHTS)))
    classes = None
    if (folder / CLASS_EMBEDDINGS).is_file():
        classes = load_file(str(folder / CLASS_EMBEDDINGS))["class_embeddings"]
    return EmbeddingModel(encoder, text, classes).eval(), tree


def log_encoder(uri: str, run_id: str, encoder: nn.Module, registered_model: str,
                config_yaml: str, card: ModelCard, text: TextTower | None = None,
                class_embeddings: Tensor | None = None) -> str:
    """Log ``encoder`` (and the ``text`` tower of clip or siglip, the learned
    ``class_embeddings`` [C, P] of projnce) under the run as a model
    from code that embeds encoded images (:mod:`serving.inputs`), register it with
    the model card as the version's description, and record every file's digest in the
    tracking store; returns the new version."""
    import mlflow

    from serving.inputs import signature

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
            info = mlflow.pyfunc.log_model(name=ARTIFACT, python_model=str(PYFUNC),
                                           artifacts=artifacts, signature=signature(),
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
