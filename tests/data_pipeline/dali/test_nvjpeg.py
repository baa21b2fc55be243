"""The torchvision device backend (``data.backend=nvjpeg``), on the CPU decoders here
(nvJPEG where CUDA is present): each JPEG decoder gives the CPU path's pixels, torchvision's
waits for the caller's stream, its crops match torchvision's resized crop whatever the chunks
of decoding, a batch of mixed 12 MP photos stays under its memory bound, running out of
memory or failing on images the CPU decodes stops the batch in one line, formats other than
JPEG are decoded on the CPU and counted, and two ranks train and resume on it (its batches
against the CPU backend's, and resume across undecodable images: ``test_device.py``)."""

from __future__ import annotations

import io
import shutil

import pytest
import torch
from PIL import Image
from torchvision.ops import roi_align
from torchvision.transforms.v2 import functional as TF

from bench.common import peak_memory_bytes
from core.config import InvalidValue
from data_pipeline.config import DataConfig
from data_pipeline.dali import colour, jpeg, nvjpeg
from data_pipeline.dali import device as device_module
from data_pipeline.dali.colour import apply_colour, colour_plan, on_device
from data_pipeline.dali.device import RenderError, rendered
from data_pipeline.dali.jpeg import JPEG_DECODERS
from data_pipeline.dali.nvjpeg import NvjpegViews
from data_pipeline.dali.params import SimCLRParams, encoded_image
from data_pipeline.formats import SkipSample
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
    got = views.crops(pictures, boxes, [(90, 120)] * 6)
    want = torch.stack([TF.resized_crop(decode(p, "p"), *box.tolist(), [16, 16], antialias=True)
                        for p, box in zip(pictures * 2, boxes, strict=True)])
    diff = (got.int() - want.int()).abs()
    assert got.shape == (12, 3, 16, 16) and got.dtype == torch.uint8
    assert diff.float().mean() < 1.0 and diff.max() <= 8


def turned_jpeg(seed: int, size: tuple[int, int]) -> bytes:
    """A photo JPEG whose EXIF orientation (6) says it is to be shown turned by 90 degrees."""
    exif = Image.Exif()
    exif[0x0112] = 6
    buffer = io.BytesIO()
    Image.open(io.BytesIO(photo_jpeg(seed, size))).save(buffer, "JPEG", quality=95,
                                                        exif=exif.tobytes())
    return buffer.getvalue()


@pytest.mark.parametrize("name", JPEG_DECODERS)
def test_each_jpeg_decoder_gives_the_cpu_paths_pixels(name):
    """Against Pillow's decode (the CPU backend's), as stored (a JPEG tagged with an EXIF
    orientation is not turned: the boxes were drawn on the stored size): equal here
    (libjpeg-turbo everywhere); one level allowed for another build's IDCT."""
    if not JPEG_DECODERS[name].available():
        pytest.skip(f"{name} is not installed")
    pictures = [photo_jpeg(i, size) for i, size in enumerate([(333, 251), (120, 90), (64, 97)])]
    pictures.append(turned_jpeg(3, (120, 60)))
    data = [torch.frombuffer(bytearray(p), dtype=torch.uint8) for p in pictures]
    for got, picture in zip(JPEG_DECODERS[name].decode(data, CPU), pictures, strict=True):
        want = decode(picture, "p")
        assert got.shape == want.shape and got.dtype == torch.uint8
        assert (got.int() - want.int()).abs().max() <= 1


def segment(marker: int, payload: bytes) -> bytes:
    return bytes([0xFF, marker]) + (len(payload) + 2).to_bytes(2, "big") + payload


def test_only_the_exif_segments_are_taken_out_of_a_jpeg():
    """After an XMP segment (APP1 too, kept), a fill byte and an Exif segment behind an
    ICC-sized APP2 of 60 KiB: the Exif goes, the rest stays and decodes to the same
    pixels; a JPEG without Exif is handed back as it is."""
    plain = photo_jpeg(0)
    xmp = segment(0xE1, b"http://ns.adobe.com/xap/1.0/\0<x/>")
    icc = segment(0xE2, b"ICC_PROFILE\0" + bytes(60_000))
    exif = segment(0xE1, b"Exif\0\0" + Image.Exif().tobytes()[6:])
    tagged = plain[:2] + xmp + icc + b"\xff" + exif + plain[2:]
    stripped = jpeg.without_exif(torch.frombuffer(bytearray(tagged), dtype=torch.uint8))
    assert bytes(stripped.numpy()) == plain[:2] + xmp + icc + plain[2:]
    assert torch.equal(decode(bytes(stripped.numpy()), "p"), decode(plain, "p"))
    untouched = torch.frombuffer(bytearray(plain), dtype=torch.uint8)
    assert jpeg.without_exif(untouched) is untouched


HOSTILE = {"no segments": b"\xff\xd8",
           "zero lengths": b"\xff\xd8\xff\xe1\x00\x00" * 1000,
           "a length past the end": b"\xff\xd8\xff\xe1\xff\xffExif\0\0",
           "endless fill bytes": b"\xff\xd8" + b"\xff" * 100_000,
           "an Exif segment then noise":
               b"\xff\xd8\xff\xe1\x00\x08Exif\0\0" + bytes(range(256)) * 20}


@pytest.mark.parametrize("name", HOSTILE)
def test_a_hostile_jpeg_header_is_walked_to_its_end_and_refused_in_one_line(name):
    """Headers that lie about their lengths, or never end, are walked within the body's
    length, and the image is refused as a corrupt image in one line."""
    body = HOSTILE[name]
    walked = jpeg.without_exif(torch.frombuffer(bytearray(body), dtype=torch.uint8))
    assert len(walked) <= len(body)
    with pytest.raises(SkipSample, match="corrupt_image") as caught:
        NvjpegViews(16, 3, CPU).decode([body])
    assert "\n" not in str(caught.value)


def test_a_decoded_size_other_than_the_headers_stops_the_batch_in_one_line():
    views = NvjpegViews(16, 3, CPU)
    boxes = torch.tensor([[0, 0, 60, 60], [0, 0, 90, 120]] * 2)
    with pytest.raises(RenderError) as caught:
        views.crops([photo_jpeg(0), photo_jpeg(1)], boxes, [(90, 120), (120, 90)])
    assert str(caught.value) == ("image 1 of a batch of 2 images (0.0 MP; largest 120x90, "
                                 "width x height) decoded as 120x90, its header says 90x120 "
                                 "(width x height)"), str(caught.value)


def test_torchvisions_decoder_waits_for_the_callers_stream_first(monkeypatch):
    """The device logic on the CPU: on a CUDA device the caller's stream is synchronised
    before torchvision's decoder is called (it writes from a stream of its own)."""
    calls = []

    class Stream:
        def synchronize(self):
            calls.append("synchronize")

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: Stream())
    monkeypatch.setattr("torchvision.io.decode_jpeg",
                        lambda data, mode, device: calls.append("decode") or data)
    jpeg.torchvision_jpegs([torch.zeros(4, dtype=torch.uint8)], torch.device("cuda", 1))
    assert calls == ["synchronize", "decode"]
    calls.clear()
    jpeg.torchvision_jpegs([torch.zeros(4, dtype=torch.uint8)], CPU)
    assert calls == ["decode"]


def test_a_decoder_that_is_not_installed_or_unknown_is_refused_in_one_line(tmp_path,
                                                                         monkeypatch):
    write_set(tmp_path, [[digit_sample(i) for i in range(8)]])
    with pytest.raises(InvalidValue, match="unknown decoder 'pillow'; choose one of auto, "
                                           "torchcodec, torchvision"):
        TrainLoader(config(tmp_path, decoder="pillow"))
    monkeypatch.setitem(JPEG_DECODERS, "torchcodec", jpeg.JpegDecoder(
        jpeg.torchcodec_jpegs, lambda: False, "pip install torchcodec"))
    with pytest.raises(InvalidValue, match="torchcodec is not installed: pip install"):
        TrainLoader(config(tmp_path, decoder="torchcodec"))
    assert jpeg.decoder_name("auto") == "torchvision"


def test_crops_do_not_depend_on_how_the_batch_is_decoded_in_chunks():
    """One image a chunk against the whole batch in one: the same crops (each image is
    sampled on its own, never padded to another's size)."""
    sizes = [(90, 120), (200, 60), (64, 64), (150, 150)]
    pictures = [photo_jpeg(i, (w, h)) for i, (h, w) in enumerate(sizes)]
    boxes = torch.tensor([[0, 0, 90, 120], [10, 5, 150, 50], [0, 0, 64, 64], [20, 30, 90, 100],
                          [40, 60, 50, 60], [0, 0, 200, 60], [3, 3, 20, 20], [100, 99, 50, 51]])
    whole = NvjpegViews(16, 3, CPU, decode_pixels=10**9).crops(pictures, boxes, sizes)
    single = NvjpegViews(16, 3, CPU, decode_pixels=1).crops(pictures, boxes, sizes)
    assert torch.equal(whole, single)


def test_each_view_equals_roi_align_on_the_whole_image():
    """The crops of a box's span (with its margin) against ``roi_align`` on the whole
    image, float32: within one level (the float rounding of the sample positions moves a
    value across a rounding boundary now and then)."""
    sizes = [(90, 120), (200, 60), (64, 64)]
    pictures = [photo_jpeg(i, (w, h)) for i, (h, w) in enumerate(sizes)]
    gen = torch.Generator().manual_seed(0)
    boxes = []
    for _ in range(2):
        for h, w in sizes:
            top, left = (int(torch.randint(0, h - 8, (), generator=gen)),
                         int(torch.randint(0, w - 8, (), generator=gen)))
            boxes.append([top, left, int(torch.randint(8, h - top + 1, (), generator=gen)),
                          int(torch.randint(8, w - left + 1, (), generator=gen))])
    boxes = torch.tensor(boxes)
    got = NvjpegViews(16, 3, CPU).crops(pictures, boxes, sizes)
    want = []
    for row, (top, left, tall, wide) in enumerate(boxes.tolist()):
        image = decode(pictures[row % 3], "p")[None].float()
        roi = torch.tensor([[0, left, top, left + wide, top + tall]], dtype=torch.float32)
        want.append(roi_align(image, roi, 16, aligned=True, sampling_ratio=-1)[0])
    want = torch.stack(want).round().clamp(0, 255)
    assert (got.float() - want).abs().max() <= 1


def test_a_jpeg_the_device_refuses_alone_is_decoded_by_pillow_and_counted(monkeypatch):
    pictures = [photo_jpeg(i) for i in range(3)]
    views = NvjpegViews(16, 3, CPU)
    real = views.decode_jpegs

    def refuses_the_second(data, device):
        if any(torch.equal(one, torch.frombuffer(bytearray(pictures[1]), dtype=torch.uint8))
               for one in data):
            raise RuntimeError("nvjpegDecodeBatched failed: unsupported")
        return real(data, device)

    monkeypatch.setattr(views, "decode_jpegs", refuses_the_second)
    images = views.decode(pictures)
    assert views.cpu_decoded == 1
    assert all(torch.equal(image, decode(picture, "p"))
               for image, picture in zip(images, pictures, strict=True))


def test_a_batch_of_mixed_12_megapixel_photos_stays_under_its_memory_bound():
    """Two 12 MP photos (one portrait, one landscape) among small ones, boxes spanning the
    large ones whole: the CPU's tensor memory while cropping (the profiler's allocations)
    stays under the bound docs/data_pipeline.md states: 3 bytes a pixel of a chunk (here
    one 12 MP image), 12 of the largest span (a 12 MP image), and the crops, with 5% over
    for the small temporaries. Padding every image to the batch's largest height and width
    would take 4 x 3 x 4000 x 4000 x 4 bytes, 768 MB."""
    sizes = [(3000, 4000), (480, 640), (4000, 3000), (500, 300)]
    pictures = [photo_jpeg(i, (w, h)) for i, (h, w) in enumerate(sizes)]
    boxes = torch.tensor([[0, 0, h, w] for h, w in sizes] + [[10, 10, 100, 100]] * 4)
    views = NvjpegViews(32, 3, CPU, decode_pixels=1_000_000)
    largest = 12_000_000
    bound = 1.05 * (3 * largest + 12 * largest + 8 * 3 * 32 * 32)
    peak = peak_memory_bytes(lambda: views.crops(pictures, boxes, sizes), CPU)
    assert peak <= bound, f"{peak / 2**20:.0f} MiB over {bound / 2**20:.0f} MiB"


def batch_of(pictures: list[bytes]) -> dict:
    """A device backend's batch of ``pictures`` as the loader workers send it."""
    draw = SimCLRParams(16)
    images = [encoded_image(p, "shard-000", f"key{i}") for i, p in enumerate(pictures)]
    batch = draw.render([draw.draw(image) for image in images] * 2)
    return {**batch, "keys": [f"key{i}" for i in range(len(pictures))], "skipped": {},
            "skipped_places": {}, "skipped_examples": []}


def test_a_batch_takes_its_device_parameters_over_in_one_copy(monkeypatch):
    """The colour steps' rows and values and the crops' boxes go to the device in one call
    of ``on_device`` a batch (one pinned copy on CUDA), and the views equal those rendered
    with a copy for the crops and one for the colour steps."""
    pictures = [photo_jpeg(i, (64 + 16 * i, 48)) for i in range(3)]
    views = NvjpegViews(16, 3, CPU)
    batch = batch_of(pictures)
    params, sizes = batch["view_params"], batch["encoded_sizes"]
    apart = apply_colour(views.crops(pictures, params["box"], sizes), colour_plan(params, 3))
    calls = []

    def counted(host, device):
        calls.append([tuple(part.shape) for part in host])
        return on_device(host, device)

    for module in (device_module, nvjpeg, colour):  # a copy made anywhere is counted
        monkeypatch.setattr(module, "on_device", counted)
    got = rendered(batch, views)["images"]
    assert len(calls) == 1 and calls[0][-1] == (3, 2, 5), calls
    assert torch.equal(got, apart)


def test_running_out_of_device_memory_stops_in_one_line_naming_the_sizes(monkeypatch):
    views = NvjpegViews(16, 3, CPU)

    def out_of_memory(data, device):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 46.00 GiB")

    monkeypatch.setattr(views, "decode_jpegs", out_of_memory)
    with pytest.raises(RenderError) as caught:
        rendered(batch_of([photo_jpeg(0, (400, 300)), photo_jpeg(1, (64, 97))]), views)
    said = str(caught.value)
    assert "\n" not in said and "ran out of device memory" in said
    assert "2 images" in said and "largest 400x300, width x height" in said, said
    assert "data.device_decode_pixels" in said and "data.batch_size" in said


def test_a_device_error_on_images_the_cpu_decodes_stops_and_drops_nothing(monkeypatch):
    """A persistent device error refuses every JPEG alone too; Pillow decodes them, so the
    batch stops naming the refusal, instead of dropping every image as corrupt or quietly
    decoding them all on the CPU."""
    views = NvjpegViews(16, 3, CPU)

    def device_error(data, device):
        raise RuntimeError("CUDA error: an illegal memory access was encountered\nmore")

    monkeypatch.setattr(views, "decode_jpegs", device_error)
    with pytest.raises(RenderError) as caught:
        rendered(batch_of([photo_jpeg(0), photo_jpeg(1), photo_jpeg(2)]), views)
    said = str(caught.value)
    assert said == (f"the device decoder ({views.decoder}) refused all 3 JPEGs of a chunk "
                    "that Pillow decodes: CUDA error: an illegal memory access was "
                    "encountered"), said


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
