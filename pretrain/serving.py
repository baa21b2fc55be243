"""The registered encoder as an MLflow pyfunc "model from code" (this plain file is what
MLflow stores and runs; no pickled object):

    model = mlflow.pyfunc.load_model("models:/<name>/<version>")
    embeddings = model.predict(pd.DataFrame({"image": [jpeg_bytes, png_bytes]}))
    features = model.predict(pd.DataFrame({"path": ["a.jpg"]}), params={"space": "backbone"})

Rows carry encoded image bytes (or a float32 .npy array [3, R, R]) or a file path; the
answer is float32 [B, D], each row L2-normalised (:mod:`pretrain.served_inputs` says what
is accepted). It rebuilds the encoder with the project's code from the version's
safetensors weights and YAML configuration (:func:`pretrain.registry.load_package`);
serving needs this package installed (the version's requirements pin it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlflow
import numpy as np


class EncoderModel(mlflow.pyfunc.PythonModel):
    """pyfunc ``predict``: request rows -> L2-normalised embeddings [B, D] (numpy)."""

    def load_context(self, context: Any) -> None:
        from pretrain.registry import load_package
        from pretrain.served_inputs import ServedImages

        self.model, tree = load_package(Path(context.artifacts["encoder"]).parent)
        self.images = ServedImages.from_config(tree)

    # model_input carries no annotation: MLflow would read one as its input schema
    def predict(self, context: Any, model_input, params: dict | None = None) -> np.ndarray:
        from pretrain.served_inputs import BadRequest, embed

        try:
            return embed(self.model, self.images, model_input, params)
        except BadRequest as err:  # answered as HTTP 400 with the one line
            raise mlflow.exceptions.MlflowException.invalid_parameter_value(str(err)) from None


mlflow.models.set_model(EncoderModel())
