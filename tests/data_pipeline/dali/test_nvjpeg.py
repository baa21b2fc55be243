"""The torchvision device backend (``data.backend=nvjpeg``), on the CPU decoder here
(nvJPEG where CUDA is present): its crops match torchvision's resized crop, formats other
than JPEG are decoded on the CPU and counted, and two ranks train and resume on it (its
batches against the CPU backend's, and resume across undecodable images:
``test_device.py``)."""

from __future__ import annotations

import io
import shutil

import pytest
import torch
from PIL import Image
from torchvision.transforms.v2 import functional as TF

from core.config import InvalidValue
from data_pipeline.config import DataConfig
from data_pipeline.dali.nvjpeg import NvjpegViews
from data_pipeline.loader import TrainLoader
from data_pipeline.transforms import decode
from tests.app.helpers import run_pretrain, train_overrides
from tests.data_pipeline.dali.test_device import photo_jpeg
from tests.data_pipeline.helpers import digit_sample, write_set

CPU = torch.device("cpu")


def config(directory, **kw) -> DataConfig:
    base = {"shards": str(directory), "batch_size": 8, "workers": 2, "resolution": 16,
            "shuffle_buffer": 16, "max_skip_fraction": 0.5, "backend": "nvjpeg"}
    return DataConfig(**(base | kw))


def test_crops_match_torchvision_resized_crop():
    """roi_align's area-averaged bins against torchvision's antialiased bilinear resize of
    the same box: over 10 sets of pictures the mean difference is 0.78 +- 0.04 of a level
    (max 6-7 levels); the bounds sit 5 standard deviations above it."""
    pictures = [photo_jpeg(i) for i in range(6)]
    boxes = torch.tensor([[0, 0, 90, 120], [10, 20, 40, 50], [5, 7, 80, 60],
                          [30, 0, 33, 120], [0, 60, 90, 60], [1, 1, 20, 24]] * 2)
    views = NvjpegViews(16, 3, CPU)
    got = views.crops(pictures, boxes)
    want = torch.stack([TF.resized_crop(decode(p, "p"), *box.tolist(), [16, 16], antialias=True)
                        for p, box in zip(pictures * 2, boxes, strict=True)])
    diff = (got.int() - want.int()).abs()
    assert got.shape == (12, 3, 16, 16) and got.dtype == torch.uint8
    assert diff.float().mean() < 1.0 and diff.max() <= 8


def test_a_png_is_decoded_on_the_cpu_and_counted():
    png = io.BytesIO()
    Image.open(io.BytesIO(photo_jpeg(1))).save(png, "PNG")
    views = NvjpegViews(16, 3, CPU)
    images = views.decode([photo_jpeg(0), png.getvalue()])
    assert [tuple(i.shape[:1]) for i in images] == [(3,), (3,)] and views.cpu_decoded == 1


def test_the_backend_renders_simclr_views_of_one_image_only(tmp_path):
    write_set(tmp_path, [[digit_sample(i) for i in range(8)]])
    for kw in ({"augment": "autoaugment"}, {"pairing": "same_label"}):
        with pytest.raises(InvalidValue, match="nvjpeg renders SimCLR views"):
            TrainLoader(DataConfig(shards=str(tmp_path), backend="nvjpeg", **kw))


def test_two_ranks_train_and_resume_on_views_rendered_on_the_device(digits_shards, tmp_path):
    """2 gloo ranks with checkpoints and loader state: a run of 6 steps, then its step 6
    checkpoint removed and the same command run again: it resumes at step 3 and ends at
    the same weights."""
    overrides = train_overrides(digits_shards, tmp_path, **{
        "data.backend": "nvjpeg", "checkpoint.every": 3, "checkpoint.keep": 2,
        "data.workers": 1, "train.max_steps": 6})
    last = tmp_path / "run" / "checkpoints" / "step_00000006"
    first = run_pretrain(overrides, nproc=2)
    assert first.returncode == 0, first.stderr[-3000:]
    whole = torch.load(last / "shared.pt", weights_only=True)["model"]
    shutil.rmtree(last)
    again = run_pretrain(overrides, nproc=2)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "at step 3" in again.stderr
    resumed = torch.load(last / "shared.pt", weights_only=True)["model"]
    for key, value in whole.items():
        assert torch.equal(resumed[key], value), key
