"""What the registered encoder's MLflow pyfunc accepts, and how a request becomes images.

A request is a table with one row per image; each row sets one of two columns:

- ``image`` (binary): the bytes of an encoded image file (JPEG, PNG, WebP: anything
  Pillow decodes), or of a float32 ``.npy`` array [3, R, R] already normalised as in
  training. Over HTTP, base64 in JSON: ``{"dataframe_records": [{"image": "<base64>"}]}``
  (MLflow's scoring server decodes binary columns).
- ``path`` (string): an image file on the serving machine.

A cell left empty ("" or null) is absent. Over HTTP, a request that mixes ``image`` and
``path`` rows gives the unused cell as "": MLflow's server base64-decodes every cell of a
binary column and fails on a null one.

Parameter ``space``: ``projector`` (default, the contrastive embedding) or ``backbone``
(the features evaluation uses). The answer is float32 [B, P] (or [B, F]), every row
L2-normalised. Files are decoded and viewed with the evaluation transform of the run
(resize the short side to 8/7 R, centre crop R, normalise), images over the run's
``data.max_image_pixels`` refused from their header; a bad row fails the request with
one line naming the row. ``.npy`` bytes are read with ``allow_pickle=False``: nothing in a
request executes code.
"""

from __future__ import annotations

import base64
import binascii
import io
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.nn import functional as F

from data_pipeline.formats import SkipSample
from data_pipeline.samples import PILLOW_MAX_PIXELS
from data_pipeline.transforms import decode, eval_view

SPACES = ("projector", "backbone")
NPY_MAGIC = b"\x93NUMPY"
ROWS_PER_FORWARD = 64  # decoded images held at once


class BadRequest(ValueError):
    """A request the encoder cannot embed; the message names the row and column."""


def signature() -> Any:
    """The pyfunc's MLflow signature: the two columns, the ``space`` parameter and the
    float32 [B, D] answer."""
    from mlflow.models import ModelSignature
    from mlflow.types.schema import ColSpec, DataType, ParamSchema, ParamSpec, Schema, TensorSpec

    return ModelSignature(
        inputs=Schema([ColSpec(DataType.binary, "image", required=False),
                       ColSpec(DataType.string, "path", required=False)]),
        outputs=Schema([TensorSpec(np.dtype(np.float32), (-1, -1))]),
        params=ParamSchema([ParamSpec("space", DataType.string, "projector")]))


@dataclass(frozen=True)
class ServedImages:
    """Turns request rows into the encoder's input, as the run's evaluation views did."""

    resolution: int
    max_pixels: int = PILLOW_MAX_PIXELS

    @staticmethod
    def from_config(tree: dict[str, Any]) -> ServedImages:
        """From a run's configuration tree (``data.resolution``, ``data.max_image_pixels``)."""
        data = tree.get("data", {})
        return ServedImages(int(data.get("resolution", 32)),
                            int(data.get("max_image_pixels", PILLOW_MAX_PIXELS)))

    def batches(self, frame: Any) -> Iterator[Tensor]:
        """[b, 3, R, R] float32 images of the rows of ``frame``, ``ROWS_PER_FORWARD`` at a
        time."""
        rows = frame.to_dict("records") if hasattr(frame, "to_dict") else list(frame)
        if not rows:
            raise BadRequest("the request has no rows; send one row per image (column "
                             "'image' or 'path')")
        view = eval_view(self.resolution)
        for start in range(0, len(rows), ROWS_PER_FORWARD):
            yield torch.stack([self._image(start + offset, row, view) for offset, row
                               in enumerate(rows[start:start + ROWS_PER_FORWARD])])

    def _image(self, index: int, row: dict[str, Any], view: Any) -> Tensor:
        image, path = _present(row.get("image")), _present(row.get("path"))
        if (image is None) == (path is None):
            raise BadRequest(f"row {index}: set exactly one of 'image' (encoded bytes) and "
                             "'path' (a file on the server)")
        where = f"row {index}: path {path}" if path is not None else f"row {index}: image"
        data = _read(path, where) if path is not None else _as_bytes(image, where)
        if data.startswith(NPY_MAGIC):
            return self._array(data, where)
        try:
            return view(decode(data, where, max_pixels=self.max_pixels))
        except SkipSample as err:  # the detail names the row and what Pillow said
            raise BadRequest(err.detail) from None

    def _array(self, data: bytes, where: str) -> Tensor:
        try:
            array = np.load(io.BytesIO(data), allow_pickle=False)
        except ValueError as err:
            raise BadRequest(f"{where}: not a readable .npy array ({err})") from None
        want = (3, self.resolution, self.resolution)
        if array.shape != want or not np.issubdtype(array.dtype, np.floating):
            raise BadRequest(f"{where}: an array must be float [3, {self.resolution}, "
                             f"{self.resolution}] (normalised as in training), got "
                             f"{array.dtype} {list(array.shape)}")
        return torch.from_numpy(array.astype(np.float32))


def embed(model: Any, images: ServedImages, frame: Any, params: dict[str, Any] | None,
          ) -> np.ndarray:
    """float32 [B, D]: L2-normalised ``space`` embeddings of the request's rows."""
    space = (params or {}).get("space") or "projector"
    if space not in SPACES:
        raise BadRequest(f"params.space: {space!r}; choose one of {', '.join(SPACES)}")
    forward = model.features if space == "backbone" else model
    parts = []
    with torch.no_grad():
        for batch in images.batches(frame):
            parts.append(F.normalize(forward(batch), dim=1))
    return torch.cat(parts).numpy()


def _present(value: Any) -> Any:
    """``value``, or None for a cell the row leaves empty (None, NaN, "" or b"")."""
    if value is None or (isinstance(value, float) and np.isnan(value)):
        return None
    return value if len(value) else None


def _as_bytes(value: Any, where: str) -> bytes:
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    if isinstance(value, str):  # base64 text from a client that did not decode it
        try:
            return base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            raise BadRequest(f"{where}: a string is read as base64, and this one is not "
                             "valid base64") from None
    raise BadRequest(f"{where}: expected bytes, got {type(value).__name__}")


def _read(path: Any, where: str) -> bytes:
    try:
        with open(str(path), "rb") as f:
            return f.read()
    except OSError as err:
        raise BadRequest(f"{where}: {err.strerror or err}") from None
