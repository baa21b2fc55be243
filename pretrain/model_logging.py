"""The encoder as an MLflow model: image batch in, projector embedding out.

Logged in MLflow's ``pickle`` format on purpose: it loads back as the eager
``torch.nn.Module`` (``mlflow.pytorch.load_model``), with a tensor signature
[-1, 3, R, R] float32 -> [-1, P] float32; MLflow 3's default ``pt2`` export would
load back a traced graph.
"""

from __future__ import annotations

import copy
from importlib.metadata import version

import torch
import torchvision
from torch import Tensor, nn


class EmbeddingModel(nn.Module):
    """The backbone plus projector; ``forward(images [B, 3, R, R]) -> [B, P]``,
    ``features(images) -> [B, F]`` gives the backbone output for evaluation."""

    def __init__(self, encoder: nn.Module) -> None:
        super().__init__()
        self.encoder = encoder

    def forward(self, images: Tensor) -> Tensor:
        return self.encoder(images)[1]

    def features(self, images: Tensor) -> Tensor:
        return self.encoder(images)[0]


def log_encoder(uri: str, run_id: str, encoder: nn.Module, example: Tensor,
                registered_model: str) -> str:
    """Log ``encoder`` under the run and register it; returns the new version."""
    import mlflow
    from mlflow.models import infer_signature

    model = EmbeddingModel(copy.deepcopy(encoder).float().cpu().eval())
    example = example.float().cpu()
    with torch.no_grad():
        output = model(example)
    signature = infer_signature(example.numpy(), output.numpy())
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    requirements = [f"torch=={torch.__version__.split('+')[0]}",
                    f"torchvision=={torchvision.__version__.split('+')[0]}",
                    f"contrastive-pretrain=={version('contrastive-pretrain')}"]
    with mlflow.start_run(run_id=run_id, log_system_metrics=False):
        info = mlflow.pytorch.log_model(model, name="encoder", signature=signature,
                                        serialization_format="pickle",
                                        pip_requirements=requirements,  # no slow inference
                                        registered_model_name=registered_model)
    return str(info.registered_model_version)
