"""What the registered encoder's MLflow pyfunc accepts, and how a request becomes images.

A request is a table with one row per image; each row sets one of two columns:

- ``image`` (binary): the bytes of an encoded JPEG, PNG or WebP file, or of a float32
  ``.npy`` array [3, R, R] already normalised as in training (values within +-1,000: NaN,
  infinities and larger values are refused). Over HTTP, base64 in JSON:
  ``{"dataframe_records": [{"image": "<base64>"}]}`` (MLflow's scoring server decodes
  binary columns).
- ``path`` (string): a file on the serving machine, read only under the root the operator
  named when starting the server (:mod:`serving.paths`); without one, path rows are
  refused.

A cell left empty ("" or null) is absent. Parameter ``space``: ``projector`` (default, the
contrastive embedding) or ``backbone`` (the features evaluation uses). The answer is
float32 [B, P] (or [B, F]), every row L2-normalised.

The work is bounded before it is done (:class:`serving.limits.ServeLimits`): the row
count, then every image's header is read and the pixels it will decode to are summed
against the request's budget (a JPEG counted at the reduced size it is decoded at,
Pillow's draft mode), and only then is anything decoded, the evaluation view of the run
applied (resize the short side to 8/7 R, centre crop R, normalise), checking the deadline
between rows. ``.npy`` headers are checked before the array is read, which is read
without pickle: nothing in a request executes code. A bad row fails the request with one
line naming the row.
"""

from __future__ import annotations

import base64
import binascii
import io
import threading
import time
import tokenize
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import Tensor
from torch.nn import functional as F

from data_pipeline.formats import SkipSample
from data_pipeline.images import PILLOW_MAX_PIXELS, opened_image
from data_pipeline.transforms import DecodeSize, decode, eval_view
from registry.versions import ServedForm
from serving.limits import ServeLimits
from serving.paths import PathRefused, PathRoot

SPACES = ("projector", "backbone")
NPY_MAGIC = b"\x93NUMPY"
ROWS_PER_FORWARD = 64  # decoded images held at once
MAX_NORMALISED = 1e3  # |value| of a normalised .npy image (mean/std normalised: within +-3)


class BadRequest(ValueError):
    """A request the encoder cannot embed; the message names the row and column."""


class Busy(BadRequest):
    """Every decoding slot stayed taken until the request's deadline."""


class Encoded(NamedTuple):
    """One row's bytes and where they came from (for messages)."""

    data: bytes
    where: str


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


def served_form() -> ServedForm:
    """What registration logs for serving: the pyfunc file (:mod:`serving.pyfunc`, a
    plain Python file MLflow stores and runs) and its signature."""
    return ServedForm(Path(__file__).with_name("pyfunc.py"), signature())


@dataclass(frozen=True)
class ServedImages:
    """Turns request rows into the encoder's input, as the run's evaluation views did."""

    resolution: int
    max_pixels: int = PILLOW_MAX_PIXELS  # per image: the run's data.max_image_pixels
    limits: ServeLimits = field(default_factory=ServeLimits)

    @staticmethod
    def from_config(tree: dict[str, Any], limits: ServeLimits | None = None) -> ServedImages:
        """From a run's configuration tree (``data.resolution``, ``data.max_image_pixels``)."""
        data = tree.get("data", {})
        return ServedImages(int(data.get("resolution", 32)),
                            int(data.get("max_image_pixels", PILLOW_MAX_PIXELS)),
                            limits or ServeLimits())

    def batches(self, frame: Any, deadline: float | None = None) -> Iterator[Tensor]:
        """[b, 3, R, R] float32 images of the rows of ``frame``, ``ROWS_PER_FORWARD`` at a
        time; ``deadline`` (``time.monotonic()``) is checked before each row."""
        rows = frame.to_dict("records") if hasattr(frame, "to_dict") else list(frame)
        if not rows:
            raise BadRequest("request: no rows; send one row per image (column 'image' or "
                             "'path')")
        if len(rows) > self.limits.max_rows:
            raise BadRequest(f"request: {len(rows)} rows, over the limit of "
                             f"{self.limits.max_rows} per request; send fewer rows")
        encoded = self._read_rows(rows)
        self._check_budget(encoded)
        view = eval_view(self.resolution)
        for start in range(0, len(encoded), ROWS_PER_FORWARD):
            images = []
            for row in encoded[start:start + ROWS_PER_FORWARD]:
                if deadline is not None and time.monotonic() > deadline:
                    raise BadRequest(f"{row.where}: the request ran past its deadline of "
                                     f"{self.limits.deadline_s:g} s; send fewer or smaller "
                                     "images")
                images.append(self._image(row, view))
            yield torch.stack(images)

    def _read_rows(self, rows: list[dict[str, Any]]) -> list[Encoded]:
        """Each row's bytes; path rows read under the root, all of them together at most
        ``max_body_bytes``."""
        paths = PathRoot(self.limits.path_root, self.limits.max_file_bytes)
        budget, encoded = self.limits.max_body_bytes, []
        for index, row in enumerate(rows):
            image, path = _present(row.get("image")), _present(row.get("path"))
            if (image is None) == (path is None):
                raise BadRequest(f"row {index}: set exactly one of 'image' (encoded bytes) "
                                 "and 'path' (a file under the server's path root)")
            if path is None:
                encoded.append(Encoded(_as_bytes(image, f"row {index}: image"),
                                       f"row {index}: image"))
                continue
            try:
                data = paths.read(path, budget)
            except PathRefused as err:
                raise BadRequest(f"row {index}: {err}") from None
            budget -= len(data)
            encoded.append(Encoded(data, f"row {index}: path"))
        return encoded

    def _check_budget(self, encoded: list[Encoded]) -> None:
        """Refuse the request when its images would decode to more pixels than the budget,
        judged from the headers alone (each image also within the run's own limit)."""
        total = 0
        for row in encoded:
            total += self._pixels(row)
            if total > self.limits.max_pixels:
                raise BadRequest(f"request: its images decode to more than "
                                 f"{self.limits.max_pixels} pixels (the per-request budget; "
                                 f"exceeded at {row.where}); send fewer or smaller images")

    def _pixels(self, row: Encoded) -> int:
        if row.data.startswith(NPY_MAGIC):
            return self.resolution ** 2
        try:
            with opened_image(row.data, row.where, self.max_pixels) as image:
                if image.format == "JPEG":  # what decode() will decode: the draft size
                    image.draft("RGB", DecodeSize(self.resolution).least(*image.size))
                return image.width * image.height
        except SkipSample as err:
            raise BadRequest(err.detail) from None

    def _image(self, row: Encoded, view: Any) -> Tensor:
        if row.data.startswith(NPY_MAGIC):
            return self._array(row)
        try:
            return view(decode(row.data, row.where, DecodeSize(self.resolution),
                               self.max_pixels))
        except SkipSample as err:  # the detail names the row and what was wrong
            raise BadRequest(err.detail) from None

    def _array(self, row: Encoded) -> Tensor:
        """A normalised float array [3, R, R]; its header is checked before it is read."""
        want = (3, self.resolution, self.resolution)
        stream = io.BytesIO(row.data)
        try:
            read_header = {(1, 0): np.lib.format.read_array_header_1_0,
                           (2, 0): np.lib.format.read_array_header_2_0}.get(
                np.lib.format.read_magic(stream))
            if read_header is None:
                raise ValueError("an unknown .npy version")
            shape, _, dtype = read_header(stream)
        except (ValueError, SyntaxError, TypeError, tokenize.TokenError, RecursionError) as err:
            # numpy tokenizes and literal-evaluates the header: an unbalanced one raises
            # TokenError, a deeply nested one RecursionError
            raise BadRequest(f"{row.where}: not a readable .npy array "
                             f"({str(err).splitlines()[0][:120] if str(err) else 'header'})"
                             ) from None
        if tuple(shape) != want or dtype.kind != "f" or dtype.hasobject:
            raise BadRequest(f"{row.where}: an array must be float [3, {self.resolution}, "
                             f"{self.resolution}] (normalised as in training), got {dtype} "
                             f"{list(shape)}")
        try:
            array = np.load(io.BytesIO(row.data), allow_pickle=False)
        except ValueError as err:
            raise BadRequest(f"{row.where}: not a readable .npy array ({err})") from None
        image = torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32))
        if not (image.abs() <= MAX_NORMALISED).all():  # NaN fails the comparison too
            raise BadRequest(f"{row.where}: the array holds NaN, infinite values or values "
                             f"beyond +-{MAX_NORMALISED:g}; send it normalised as in training")
        return image


def embed(model: Any, images: ServedImages, frame: Any, params: dict[str, Any] | None,
          gate: threading.Semaphore | None = None) -> np.ndarray:
    """float32 [B, D]: L2-normalised ``space`` embeddings of the request's rows. With a
    ``gate``, at most its count of requests decode at once; a request that gets no slot
    before its deadline is refused as :class:`Busy`."""
    deadline = time.monotonic() + images.limits.deadline_s
    space = (params or {}).get("space") or "projector"
    if space not in SPACES:
        raise BadRequest(f"params.space: {str(space)[:40]!r}; choose one of "
                         f"{', '.join(SPACES)}")
    if gate is not None and not gate.acquire(timeout=images.limits.deadline_s):
        raise Busy(f"request: the server stayed busy for {images.limits.deadline_s:g} s; "
                   "retry later")
    try:
        forward = model.features if space == "backbone" else model
        parts = []
        with torch.no_grad():
            for batch in images.batches(frame, deadline):
                parts.append(F.normalize(forward(batch), dim=1))
        embeddings = torch.cat(parts)
    finally:
        if gate is not None:
            gate.release()
    unfit = (~torch.isfinite(embeddings).all(dim=1)).nonzero().flatten()
    if len(unfit):  # a value too large for the encoder's arithmetic, e.g. 3e38
        raise BadRequest(f"row {int(unfit[0])}: its features are not finite; the encoder "
                         "takes images normalised as in training")
    return embeddings.numpy()


def _present(value: Any) -> Any:
    """``value``, or None for a cell the row leaves empty (None, NaN, "" or b"")."""
    if value is None or (isinstance(value, float) and np.isnan(value)):
        return None
    try:
        return value if len(value) else None
    except TypeError:  # a number or another scalar: not a cell this model takes
        return value


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
