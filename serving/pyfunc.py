"""The registered encoder as an MLflow pyfunc "model from code" (this plain file is what
MLflow stores and runs; no pickled object):

    model = mlflow.pyfunc.load_model("models:/<name>/<version>")
    embeddings = model.predict(pd.DataFrame({"image": [jpeg_bytes, png_bytes]}))
    features = model.predict(pd.DataFrame({"image": [jpeg_bytes]}),
                             params={"space": "backbone"})

Rows carry encoded image bytes (or a float32 .npy array [3, R, R]) or, where the server was
started with a path root, a file path; the answer is float32 [B, D], each row
L2-normalised (:mod:`serving.inputs` says what is accepted and how the work is bounded).
It rebuilds the encoder with the project's code from the version's safetensors weights and
YAML configuration (:func:`registry.package.load_package`); serving needs this
package installed (the version's requirements pin it). ``serving.server`` verifies every
file of the version, this one included, before MLflow runs it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import threading
from pathlib import Path
from typing import Any

import mlflow
import numpy as np

from serving.guard import MARK  # starts every refusal of ours; the guard finds it

log = logging.getLogger("serving")
FAULT = "encoder fault: "  # an exception of our own code: a 500 (the guard's fixed line)


class EncoderModel(mlflow.pyfunc.PythonModel):
    """pyfunc ``predict``: request rows -> L2-normalised embeddings [B, D] (numpy)."""

    def load_context(self, context: Any) -> None:
        from registry.package import load_package
        from serving.limits import ServeLimits

        self.model, self.tree = load_package(Path(context.artifacts["encoder"]).parent)
        self.configure(ServeLimits())

    def configure(self, limits: Any) -> None:
        """Serve under ``limits`` (:class:`serving.limits.ServeLimits`): the defaults
        refuse path rows; ``serving.server`` passes the operator's settings."""
        from serving.inputs import ServedImages

        self.images = ServedImages.from_config(self.tree, limits)
        self.gate = threading.BoundedSemaphore(limits.concurrent)

    # model_input carries no annotation: MLflow would read one as its input schema
    def predict(self, context: Any, model_input, params: dict | None = None) -> np.ndarray:
        from mlflow.exceptions import MlflowException
        from mlflow.protos.databricks_pb2 import INTERNAL_ERROR, TEMPORARILY_UNAVAILABLE

        from serving.inputs import BadRequest, Busy, embed

        try:
            return embed(self.model, self.images, model_input, params, self.gate)
        except Busy as err:  # HTTP 503
            raise MlflowException(f"{MARK}{err}", TEMPORARILY_UNAVAILABLE) from None
        except BadRequest as err:  # HTTP 400 with the one line
            raise MlflowException.invalid_parameter_value(f"{MARK}{err}") from None
        except Exception as err:  # a fault of ours: HTTP 500, the detail in the log only
            log.exception("internal error in predict")
            raise MlflowException(f"{FAULT}{type(err).__name__}", INTERNAL_ERROR) from None
        finally:
            release_memory()


def release_memory() -> None:
    """Hand the heap that decoded images freed back to the system (glibc's
    ``malloc_trim``), so the server's memory returns near its idle level after large
    requests; a no-op where the C library has no such call."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Any:
    name = ctypes.util.find_library("c")
    return getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None


mlflow.models.set_model(EncoderModel())
