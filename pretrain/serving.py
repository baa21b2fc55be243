"""The registered encoder as an MLflow pyfunc "model from code" (this plain file is what
MLflow stores and runs; no pickled object):

    model = mlflow.pyfunc.load_model("models:/<name>/<version>")
    embeddings = model.predict(images)  # float32 [B, 3, R, R] -> float32 [B, P]

It rebuilds the encoder with the project's code from the version's safetensors weights and
YAML configuration (:func:`pretrain.registry.load_package`); serving needs this package
installed (the version's requirements pin it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlflow
import numpy as np
import torch


class EncoderModel(mlflow.pyfunc.PythonModel):
    """pyfunc ``predict``: images [B, 3, R, R] -> projector embeddings [B, P] (numpy)."""

    def load_context(self, context: Any) -> None:
        from pretrain.registry import load_package

        self.model, _ = load_package(Path(context.artifacts["encoder"]).parent)

    # model_input carries no annotation: MLflow would read one as its input schema
    def predict(self, context: Any, model_input, params: dict | None = None) -> np.ndarray:
        images = torch.as_tensor(np.asarray(model_input, dtype=np.float32))
        with torch.no_grad():
            return self.model(images).numpy()


mlflow.models.set_model(EncoderModel())
