"""Load the encoder to evaluate: a checkpoint, an MLflow run, or a registry URI."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from pretrain.config import from_dict
from pretrain.model import ContrastiveModel
from pretrain.model_logging import EmbeddingModel


@dataclass
class ModelRef:
    """Where the model came from: its source, and registry/run identity when known."""

    source: str
    run_id: str | None = None
    name: str | None = None
    version: str | None = None


def from_checkpoint(path: Path) -> tuple[EmbeddingModel, dict]:
    """A checkpoint directory (or its ``shared.pt``) -> the encoder, the run's config dict."""
    from pretrain.run_config import RunConfig

    file = path / "shared.pt" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"eval.model={path}: no checkpoint (shared.pt) there")
    state = torch.load(file, map_location="cpu", weights_only=True)
    tree = yaml.safe_load(state["config"])
    config = from_dict(RunConfig, tree)
    objective = config.objective
    model = ContrastiveModel(config.model, with_text=objective.name == "clip",
                             learnable_temperature=(objective.temperature
                                                    if objective.learnable_temperature
                                                    else None))
    model.load_state_dict(state["model"])
    return EmbeddingModel(model.encoder), tree


def resolve(source: str, uri: str) -> ModelRef:
    """Registry identity of ``models:/name/<version|latest>`` or ``models:/name@alias``."""
    import mlflow

    client = mlflow.MlflowClient(uri, registry_uri=uri)
    if source.startswith("runs:/"):
        return ModelRef(source, run_id=source.split("/")[1])
    spec = source[len("models:/"):]
    if "@" in spec:
        name, alias = spec.split("@", 1)
        version = client.get_model_version_by_alias(name, alias)
    else:
        name, number = spec.rsplit("/", 1)
        if number == "latest":
            number = str(max(int(v.version) for v in
                             client.search_model_versions(f"name='{name}'")))
        version = client.get_model_version(name, number)
    return ModelRef(source, version.run_id, name, str(version.version))


def load_model(source: str, run_dir: Path, uri: str) -> tuple[EmbeddingModel, ModelRef]:
    """``eval.model`` -> (model, reference); "" means the run's newest checkpoint."""
    if source.startswith(("runs:/", "models:/")):
        import mlflow

        ref = resolve(source, uri)
        mlflow.set_tracking_uri(uri)
        mlflow.set_registry_uri(uri)
        if ref.version is not None:  # load exactly the version resolved above
            source = f"models:/{ref.name}/{ref.version}"
        model = mlflow.pytorch.load_model(source, map_location="cpu")
        return model, ref
    path = Path(source) if source else _newest(run_dir)
    model, _ = from_checkpoint(path)
    run_id_file = run_dir / "mlflow_run_id"
    run_id = run_id_file.read_text().strip() if run_id_file.is_file() else None
    return model, ModelRef(str(path), run_id=run_id)


def _newest(run_dir: Path) -> Path:
    checkpoints = sorted((run_dir / "checkpoints").glob("step_*"))
    if not checkpoints:
        raise FileNotFoundError(f"eval.model is empty and {run_dir}/checkpoints has none")
    return checkpoints[-1]
