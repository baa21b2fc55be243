"""What the served encoder accepts: encoded image bytes (JPEG, PNG, base64 text), file
paths and normalised .npy arrays become the evaluation view of the image, computed here
independently with Pillow and torchvision's functional ops; answers are L2-normalised in
the chosen space; every bad row is refused in one line naming it."""

from __future__ import annotations

import base64
import io
import pickle

import numpy as np
import pandas as pd
import pytest
import torch
import torchvision.transforms.v2.functional as TF
from PIL import Image

from pretrain.model.encoder import Encoder, ModelConfig
from registry.package import EmbeddingModel
from serving.inputs import BadRequest, ServedImages, embed
from serving.limits import ServeLimits

R = 16
MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def encoded(fmt: str, size: tuple[int, int] = (40, 28), seed: int = 0) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format=fmt)
    return out.getvalue()


def reference_view(data: bytes) -> torch.Tensor:
    """The evaluation view by hand: short side to 8/7 R, centre crop R, scale, normalise."""
    image = torch.from_numpy(np.array(Image.open(io.BytesIO(data)).convert("RGB")))
    image = image.permute(2, 0, 1)
    image = TF.resize(image, [R * 8 // 7], antialias=True)
    image = TF.center_crop(image, [R, R]).float() / 255
    return TF.normalize(image, MEAN, STD)


def npy(array: np.ndarray) -> bytes:
    out = io.BytesIO()
    np.save(out, array)
    return out.getvalue()


def array_rows(images: torch.Tensor) -> pd.DataFrame:
    """A request of normalised images [B, 3, R, R] as .npy rows."""
    return pd.DataFrame({"image": [npy(image) for image in images.numpy()]})


def images_of(frame: pd.DataFrame) -> torch.Tensor:
    return torch.cat(list(ServedImages(R).batches(frame)))


def test_encoded_images_paths_base64_and_arrays_become_the_evaluation_view(tmp_path):
    jpeg, png = encoded("JPEG"), encoded("PNG", (20, 33), seed=1)
    (tmp_path / "a.png").write_bytes(png)
    array = np.random.default_rng(2).standard_normal((3, R, R)).astype(np.float32)
    frame = pd.DataFrame({"image": [jpeg, b"", base64.b64encode(png).decode(), npy(array)],
                          "path": [None, "a.png", "", np.nan]})
    got = torch.cat(list(ServedImages(R, limits=ServeLimits(path_root=str(tmp_path)))
                         .batches(frame)))
    assert got.shape == (4, 3, R, R) and got.dtype == torch.float32
    torch.testing.assert_close(got[0], reference_view(jpeg), atol=1e-5, rtol=0)
    torch.testing.assert_close(got[1], reference_view(png), atol=1e-5, rtol=0)
    torch.testing.assert_close(got[2], got[1], atol=0, rtol=0)  # base64 text of the same file
    torch.testing.assert_close(got[3], torch.from_numpy(array), atol=0, rtol=0)


def test_rows_go_through_in_bounded_batches(monkeypatch):
    from serving import inputs as served_inputs

    monkeypatch.setattr(served_inputs, "ROWS_PER_FORWARD", 2)
    frame = pd.DataFrame({"image": [encoded("PNG", seed=s) for s in range(5)]})
    sizes = [len(b) for b in ServedImages(R).batches(frame)]
    assert sizes == [2, 2, 1]


def test_answers_are_unit_rows_of_the_chosen_space():
    torch.manual_seed(0)
    model = EmbeddingModel(Encoder(ModelConfig(width=8, projector_hidden=16,
                                               projector_dim=8))).eval()
    frame = pd.DataFrame({"image": [encoded("JPEG", seed=s) for s in range(3)]})
    views = images_of(frame)
    for space, want in (("projector", model(views)), ("backbone", model.features(views))):
        got = embed(model, ServedImages(R), frame, {"space": space})
        assert got.dtype == np.float32
        np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1, rtol=1e-5)
        want = torch.nn.functional.normalize(want.detach(), dim=1).numpy()
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert embed(model, ServedImages(R), frame, None).shape == (3, 8)  # projector by default
    with pytest.raises(BadRequest, match="params.space: 'pixels'; choose one of projector"):
        embed(model, ServedImages(R), frame, {"space": "pixels"})


def test_a_row_whose_features_are_not_finite_is_refused_naming_it():
    def overflowing(images: torch.Tensor) -> torch.Tensor:  # an encoder's overflow in row 1
        out = torch.ones(len(images), 4)
        out[1, 2] = float("inf")
        return out

    frame = pd.DataFrame({"image": [encoded("JPEG", seed=s) for s in range(3)]})
    with pytest.raises(BadRequest, match="row 1: its features are not finite"):
        embed(overflowing, ServedImages(R), frame, None)


class Boom:
    def __reduce__(self):
        return (exec, ("raise SystemExit('pickle executed')",))


@pytest.mark.parametrize(("row", "message"), [
    ({"image": b"not an image"}, "row 0: image: not a readable JPEG, PNG or WebP image"),
    ({"image": "%%%"}, "row 0: image: a string is read as base64, and this one is not"),
    ({"image": None, "path": None}, "row 0: set exactly one of 'image'"),
    ({"image": b"x", "path": "a.jpg"}, "row 0: set exactly one of 'image'"),
    ({"path": "/nonexistent/a.jpg"}, "row 0: path: path rows are off on this server"),
    ({"image": npy(np.zeros((3, 8, 8), np.float32))},
     r"row 0: image: an array must be float \[3, 16, 16\].*got float32 \[3, 8, 8\]"),
    ({"image": npy(np.array([Boom()], dtype=object))},
     r"row 0: image: an array must be float.*got object \[1\]"),
    ({"image": pickle.dumps(Boom())}, "row 0: image: not a readable JPEG, PNG or WebP"),
    ({"image": npy(np.full((3, 16, 16), np.nan, np.float32))},
     r"row 0: image: the array holds NaN, infinite values or values beyond \+-1000"),
    ({"image": npy(np.full((3, 16, 16), 1001.0, np.float32))}, r"beyond \+-1000"),
    ({"image": npy(np.full((3, 16, 16), 1e300))}, r"beyond \+-1000"),  # float64: inf in float32
])
def test_a_bad_row_is_refused_in_one_line_naming_it(row, message):
    with pytest.raises(BadRequest, match=message) as err:
        images_of(pd.DataFrame([row]))
    assert "\n" not in str(err.value)


def test_images_over_the_run_s_pixel_limit_are_refused_from_their_header():
    frame = pd.DataFrame({"image": [encoded("PNG", (40, 28))]})
    with pytest.raises(BadRequest, match=r"row 0: image: 40 x 28 = 1120 pixels exceed the "
                                         r"limit of 1000"):
        list(ServedImages(R, max_pixels=1000).batches(frame))
    assert ServedImages.from_config({"data": {"resolution": 24, "max_image_pixels": 7}}) == (
        ServedImages(24, 7, ServeLimits()))


def test_an_empty_request_says_what_to_send():
    with pytest.raises(BadRequest, match="request: no rows; send one row per image"):
        images_of(pd.DataFrame({"image": []}))


def test_rows_pixels_and_files_are_bounded_before_any_decode(tmp_path, monkeypatch):
    from serving import inputs as served_inputs

    decoded = []
    monkeypatch.setattr(served_inputs, "decode", lambda *a, **k: decoded.append(1))
    small = ServedImages(R, limits=ServeLimits(max_rows=2, max_pixels=1200,
                                               max_file_bytes=100, path_root=str(tmp_path)))
    three = pd.DataFrame({"image": [encoded("PNG", (10, 10))] * 3})
    with pytest.raises(BadRequest, match="request: 3 rows, over the limit of 2 per request"):
        list(small.batches(three))
    two = pd.DataFrame({"image": [encoded("PNG", (40, 28)), encoded("PNG", (30, 10))]})
    with pytest.raises(BadRequest, match=r"decode to more than 1200 pixels .*exceeded at "
                                         r"row 1: image"):
        list(small.batches(two))  # 1120 + 300: the first alone fits, both do not
    (tmp_path / "big.png").write_bytes(encoded("PNG", (40, 40), seed=3))
    with pytest.raises(BadRequest, match="row 0: path: not a readable file under the serving"):
        list(small.batches(pd.DataFrame({"path": ["big.png"]})))  # over max_file_bytes
    assert decoded == []


def test_a_jpeg_counts_at_the_reduced_size_it_is_decoded_at():
    """A 400 x 400 JPEG served at 16 px decodes at 1/8 (50 x 50 = 2,500 pixels)."""
    frame = pd.DataFrame({"image": [encoded("JPEG", (400, 400))]})
    assert len(list(ServedImages(R, limits=ServeLimits(max_pixels=2_500)).batches(frame))) == 1
    with pytest.raises(BadRequest, match="decode to more than 2499 pixels"):
        list(ServedImages(R, limits=ServeLimits(max_pixels=2_499)).batches(frame))


def test_a_request_past_its_deadline_or_without_a_slot_is_refused():
    import threading
    import time

    from serving.inputs import Busy

    frame = pd.DataFrame({"image": [encoded("PNG", seed=s) for s in range(3)]})
    images = ServedImages(R, limits=ServeLimits(deadline_s=0.2))
    with pytest.raises(BadRequest, match=r"row 0: image: the request ran past its deadline of "
                                         r"0.2 s"):
        list(images.batches(frame, deadline=time.monotonic() - 1))
    model = EmbeddingModel(Encoder(ModelConfig(width=8, projector_hidden=16,
                                               projector_dim=8))).eval()
    gate = threading.BoundedSemaphore(1)
    gate.acquire()  # the one slot is taken
    started = time.monotonic()
    with pytest.raises(Busy, match="request: the server stayed busy for 0.2 s"):
        embed(model, images, frame, None, gate)
    assert 0.15 < time.monotonic() - started < 5
    gate.release()
    assert embed(model, images, frame, None, gate).shape == (3, 8)
