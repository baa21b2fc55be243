"""The device backends end to end (DALI's CPU operators and torchvision's CPU decoder
here, nvJPEG where CUDA is present): DALI's crops match torchvision's, each backend's
batches match the CPU backend's, resume is exact, and an image that does not decode is
dropped and counted."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from PIL import Image
from torchvision.transforms.v2 import functional as TF

from core.config import InvalidValue
from data_pipeline.config import DataConfig
from data_pipeline.dali import dali_available
from data_pipeline.dali.device import DaliViews
from data_pipeline.formats import Sample
from data_pipeline.loader import LoaderState, TrainLoader, train_batches
from data_pipeline.loader.backends import backend_spec
from data_pipeline.transforms import decode
from tests.data_pipeline.helpers import (
    digit_jpeg,
    digit_sample,
    live_loader_workers,
    uneven_set,
    write_set,
)

LEVEL = 1 / 255 / 0.229  # one uint8 level after normalising (the largest of the channels)


def config(directory, **kw) -> DataConfig:
    base = {"shards": str(directory), "batch_size": 8, "workers": 2, "resolution": 16,
            "shuffle_buffer": 16, "max_skip_fraction": 0.5, "backend": "dali"}
    return DataConfig(**(base | kw))


def photo_jpeg(seed: int, size: tuple[int, int] = (120, 90)) -> bytes:
    """A smooth colour picture (an upsampled random 6 x 5 image), as photos are."""
    gen = torch.Generator().manual_seed(seed)
    small = torch.randint(0, 256, (5, 6, 3), generator=gen, dtype=torch.uint8).numpy()
    buffer = io.BytesIO()
    Image.fromarray(small).resize(size, Image.BICUBIC).save(buffer, "JPEG", quality=95)
    return buffer.getvalue()


def undecodable_jpeg() -> bytes:
    """A JPEG whose header reads but whose Huffman table is bogus: only decoding finds it."""
    data = bytearray(digit_jpeg(0))
    table = data.index(b"\xff\xc4")
    data[table + 5:table + 21] = b"\xff" * 16
    return bytes(data)


# DALI's cases where it is installed (a GPU node may lack it); torchvision's everywhere
needs_dali = pytest.mark.skipif(not dali_available(), reason="NVIDIA DALI is not installed")


@needs_dali
def test_crops_match_torchvision_resized_crop():
    """DALI's antialiased linear resize of a box vs torchvision's: within a quarter of a
    level on average and 8 levels at worst (the filters' footprints differ at the edges).
    Over 10 sets of pictures the mean is 0.224 +- 0.006 (max 4-6), the same under
    ATEN_CPU_CAPABILITY=avx2: the bound sits 4 standard deviations above it."""
    pictures = [photo_jpeg(i) for i in range(6)]
    boxes = torch.tensor([[0, 0, 90, 120], [10, 20, 40, 50], [5, 7, 80, 60],
                          [30, 0, 33, 120], [0, 60, 90, 60], [1, 1, 20, 24]] * 2)
    got = DaliViews(16, 3, torch.device("cpu")).crops(pictures, boxes)
    want = torch.stack([TF.resized_crop(decode(p, "p"), *box.tolist(), [16, 16], antialias=True)
                        for p, box in zip(pictures * 2, boxes, strict=True)])
    diff = (got.int() - want.int()).abs()
    assert got.shape == (12, 3, 16, 16) and got.dtype == torch.uint8
    assert diff.float().mean() < 0.25 and diff.max() <= 8


# the device backends, and the mean pixel difference from the CPU path each is held to:
# their resize filters' (test_crops_match_torchvision_resized_crop, here and in
# test_nvjpeg.py), in normalised units
DEVICE_BACKENDS = {"dali": 0.5 * LEVEL, "nvjpeg": 1.5 * LEVEL}
BACKEND_CASES = [pytest.param(name, marks=needs_dali if name == "dali" else ())
                 for name in DEVICE_BACKENDS]


@pytest.mark.parametrize("backend", BACKEND_CASES)
def test_batches_match_the_cpu_backend(tmp_path, backend):
    """Same keys, ids, labels and view parameters; the pixels differ only by the resize
    filters (CPU backend without reduced decoding, so both crop the stored image)."""
    uneven_set(tmp_path, [24, 24])
    cpu = list(train_batches(config(tmp_path, backend="cpu", draft_decode=False)))
    device = list(train_batches(config(tmp_path, backend=backend)))
    assert len(cpu) == len(device) == 6
    for want, got in zip(cpu, device, strict=True):
        assert got["keys"] == want["keys"] and got["captions"] == want["captions"]
        assert torch.equal(got["ids"], want["ids"]) and torch.equal(got["labels"],
                                                                    want["labels"])
        assert "encoded" not in got and got["images"].shape == want["images"].shape
        assert (got["images"] - want["images"]).abs().mean() < DEVICE_BACKENDS[backend]


@pytest.mark.parametrize("backend", BACKEND_CASES)
def test_resume_continues_exactly_and_undecodable_images_are_dropped(tmp_path, backend):
    def bogus(key: str) -> Sample:
        return Sample(key, undecodable_jpeg(), "jpg", 1, "a caption")

    shards = [[digit_sample(i) for i in range(10)] + [bogus("bogus0")]
              + [digit_sample(i) for i in range(10, 20)],
              [digit_sample(i) for i in range(20, 40)] + [bogus("bogus1")]]
    write_set(tmp_path, shards)
    cfg = config(tmp_path, batch_size=4, shuffle_buffer=8, backend=backend)
    state, full, snapshots = LoaderState(), [], []
    for batch in train_batches(cfg, state=state):
        full.append(batch)
        snapshots.append(LoaderState.from_state_dict(copy.deepcopy(state.state_dict())))
    short = [i for i, b in enumerate(full) if len(b["keys"]) < 4]
    stop = short[-1]  # resumed just before the last batch with a sample dropped
    assert stop >= 1, "an undecodable sample is drawn after the resume point"
    dropped = [b for b in full[stop:] if len(b["keys"]) < 4]
    for batch in dropped:
        assert batch["images"].shape[0] == batch["ids"].shape[0] == 2 * len(batch["keys"])
        assert not any("bogus" in key for key in batch["keys"])
        assert batch["skipped"]["corrupt_image"] >= 1
        assert any("bogus" in e for e in batch["skipped_examples"])
    assert state.skipped["corrupt_image"] == sum(b["skipped"].get("corrupt_image", 0)
                                                 for b in full)
    assert not live_loader_workers()  # ended with the epoch, not left to the collector
    resumed = list(train_batches(cfg, state=snapshots[stop - 1]))
    assert len(resumed) == len(full) - stop
    for got, want in zip(resumed, full[stop:], strict=True):
        assert got["keys"] == want["keys"] and torch.equal(got["images"], want["images"])


def test_the_backend_renders_simclr_views_of_one_image_only(tmp_path):
    for kw in ({"augment": "autoaugment"}, {"pairing": "same_label"}):
        with pytest.raises(InvalidValue, match="needs data.augment=simclr"):
            backend_spec("dali").check(DataConfig(backend="dali", **kw))
    write_set(tmp_path, [[digit_sample(i) for i in range(8)]])
    with pytest.raises(InvalidValue, match="needs data.augment=simclr"):  # the loader asks
        TrainLoader(DataConfig(shards=str(tmp_path), backend="dali", augment="autoaugment"))


@needs_dali
@pytest.mark.skipif(not torch.cuda.is_available(), reason="nvJPEG needs CUDA")
def test_gpu_decoding_matches_the_cpu_operators(tmp_path):
    pictures = [photo_jpeg(i, (640, 480)) for i in range(8)]
    boxes = torch.tensor([[i * 10, i * 20, 300, 400] for i in range(8)] * 2)
    on_cpu = DaliViews(64, 7, torch.device("cpu")).crops(pictures, boxes)
    on_gpu = DaliViews(64, 7, torch.device("cuda")).crops(pictures, boxes)
    assert on_gpu.is_cuda
    assert (on_gpu.cpu().int() - on_cpu.int()).abs().float().mean() < 1.0
    uneven_set(tmp_path, [24, 24])
    batch = next(iter(train_batches(config(tmp_path), device=torch.device("cuda"))))
    assert batch["images"].is_cuda and batch["images"].shape == (16, 3, 16, 16)


@needs_dali
def test_dali_works_on_the_stream_current_where_it_first_renders(monkeypatch):
    """The device logic on the CPU: DALI's context is made at the first render, in the
    render thread, with the stream current there (the side stream), not at construction
    on the trainer's."""
    views = DaliViews(16, 3, torch.device("cuda", 1))
    made = []
    monkeypatch.setattr(views.ndd, "EvalContext", lambda **kw: made.append(kw) or kw)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: f"current on {device}")
    assert made == []
    assert views.context == views.context  # made once
    assert made == [{"device_id": 1, "num_threads": 2, "cuda_stream": "current on cuda:1"}]
