"""Load the encoder to evaluate: a checkpoint, an MLflow run, or a registry URI.

Every source is rebuilt with the project's code from tensors and YAML: checkpoints load
``weights_only``, registered models are verified file by file against their registered
digests and read from safetensors (:mod:`serving.model_registry`); nothing is unpickled
but a sharded checkpoint's DCP metadata, through an unpickler that rebuilds DCP's own
records only (:class:`pretrain.run.sharded.MetadataUnpickler`).
"""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path
from typing import Any, NamedTuple

import torch
import yaml

from core.config import from_dict
from pretrain.model.encoder import (
    ModelConfig,
    class_embeddings_from_state,
    encoder_from_state,
    text_tower_from_state,
)
from pretrain.run.checkpoint import list_checkpoints, model_state_of
from pretrain.run.tracking import run_id_of
from registry.package import EmbeddingModel
from registry.versions import ModelRef, download_verified, resolve


def from_checkpoint(path: Path, key: str = "eval.model") -> tuple[EmbeddingModel, dict]:
    """A checkpoint directory (or its ``shared.pt``) -> the encoder (with CLIP's text tower
    and ProjNCE's class embeddings when the run trained them), the run's config dict.

    Only the checkpoint's model state is needed to rebuild them (in ``shared.pt``, or the
    sharded state of ``checkpoint.format=sharded``, read whole in this process).
    """
    file = path / "shared.pt" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"{key}={path}: no checkpoint (shared.pt) there")
    shared, state = model_state_of(file.parent)
    tree = yaml.safe_load(shared["config"])
    model_cfg = from_dict(ModelConfig, tree.get("model", {}), prefix="model.")
    return EmbeddingModel(encoder_from_state(model_cfg, state),
                          text_tower_from_state(model_cfg, state),
                          class_embeddings_from_state(state)), tree


def untrained_copy(model: EmbeddingModel, seed: int) -> EmbeddingModel:
    """The same architecture with freshly initialised weights (and batch-norm statistics):
    the floor a trained encoder is compared with."""
    fresh = copy.deepcopy(model)
    torch.manual_seed(seed)
    for module in fresh.modules():
        reset = getattr(module, "reset_parameters", None)
        if callable(reset):
            reset()
    return fresh


class Loaded(NamedTuple):
    """An encoder to evaluate or export: the model, its run's configuration tree and the
    reference it was loaded by."""

    model: EmbeddingModel
    tree: dict[str, Any]
    ref: ModelRef


def load_model(source: str, run_dir: Path, uri: str) -> tuple[EmbeddingModel, ModelRef]:
    """``eval.model`` -> (model, reference); "" means the run's newest checkpoint."""
    loaded = load_encoder(source, run_dir, uri)
    return loaded.model, loaded.ref


def load_encoder(source: str, run_dir: Path, uri: str, key: str = "eval.model") -> Loaded:
    """A checkpoint directory ("": ``run_dir``'s newest), ``runs:/`` or ``models:/`` URI
    (registry files checked against their digests first) -> :class:`Loaded`."""
    if source.startswith(("runs:/", "models:/")):
        import mlflow

        ref, record = resolve(source, uri, key=key)
        mlflow.set_tracking_uri(uri)
        mlflow.set_registry_uri(uri)
        with tempfile.TemporaryDirectory() as tmp:  # exactly the version resolved
            model, tree = download_verified(
                ref.storage or source, uri, record, Path(tmp),
                label=ref.version and f"models:/{ref.name}/{ref.version}")
        return Loaded(model, tree, ref)
    path = Path(source) if source else _newest(run_dir)
    model, tree = from_checkpoint(path, key)
    return Loaded(model, tree, ModelRef(str(path), run_id=run_id_of(run_dir)))


def _newest(run_dir: Path) -> Path:
    checkpoints = list_checkpoints(run_dir)
    if not checkpoints:
        raise FileNotFoundError(f"eval.model is empty and {run_dir}/checkpoints has none")
    return checkpoints[0]
