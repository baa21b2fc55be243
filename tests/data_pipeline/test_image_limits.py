"""Images Pillow refuses, decompression bombs included: skipped and counted with their
path in make-shards and in both loaders, at the configured pixel limit
(``shards.max_image_pixels``, ``data.max_image_pixels``), instead of ending the job."""

from __future__ import annotations

import io
import struct
import zlib
from collections import Counter

import pytest
from PIL import Image

from data_pipeline.config import DataConfig, ShardsConfig
from data_pipeline.formats import Sample, SkipSample
from data_pipeline.images import check_image
from data_pipeline.loader import eval_batches
from data_pipeline.loader.state import LoaderState
from data_pipeline.make_shards import make_shards
from data_pipeline.transforms import decode
from tests.data_pipeline.helpers import digit_sample, save_image, write_set


def png_chunk(kind: bytes, data: bytes) -> bytes:
    return (struct.pack(">I", len(data)) + kind + data
            + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))


def bomb_png(width: int, height: int) -> bytes:
    """A valid PNG header of ``width`` x ``height`` pixels in a few dozen bytes (the body of
    a real bomb, rows of zeros, compresses ~1000:1; Pillow refuses it from the header)."""
    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)  # 8-bit greyscale
    return (b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", header)
            + png_chunk(b"IDAT", zlib.compress(b"")) + png_chunk(b"IEND", b""))


def png(width: int, height: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), (200, 30, 90)).save(out, format="PNG")
    return out.getvalue()


def test_a_30000_px_square_bomb_is_refused_at_pillows_default_limit():
    bomb = bomb_png(30_000, 30_000)
    assert len(bomb) < 100
    for read in (lambda: check_image(bomb, "tree/n01/bomb.png"),
                 lambda: decode(bomb, "tree/n01/bomb.png")):
        with pytest.raises(SkipSample) as skipped:
            read()
        assert skipped.value.reason == "corrupt_image"
        assert skipped.value.detail.startswith("tree/n01/bomb.png: 900000000 "
                                               "pixels exceed the limit of 89478485")


def test_the_limit_is_exact_and_configurable():
    check_image(png(100, 100), "ok", max_pixels=10_000)  # at the limit: read
    with pytest.raises(SkipSample, match="10100 pixels exceed the limit of 10000"):
        check_image(png(101, 100), "over", max_pixels=10_000)  # Pillow would only warn here
    assert decode(png(101, 100), "no limit", max_pixels=0).shape == (3, 100, 101)


def test_make_shards_skips_and_counts_a_bomb_in_an_image_tree(tmp_path):
    root = tmp_path / "tree"
    for j in range(4):
        save_image(root / "n01" / f"n01_{j}.JPEG", j)
    (root / "n01" / "bomb.PNG").write_bytes(bomb_png(30_000, 30_000))
    manifest = make_shards(ShardsConfig(source="imagenet", input=str(root), workers=2,
                                        output=str(tmp_path / "s"), shard_size=10))
    assert manifest.total_samples == 4 and manifest.skipped == {"corrupt_image": 1}


def test_both_loaders_skip_and_count_an_image_over_the_limit_naming_it(tmp_path):
    big = Sample("big", png(120, 120), "png", 1, "a caption")
    write_set(tmp_path, [[digit_sample(i) for i in range(11)] + [big]])  # 3 full batches
    cfg = DataConfig(shards=str(tmp_path), batch_size=4, workers=0, resolution=16,
                     shuffle_buffer=4, max_skip_fraction=0.5, max_image_pixels=10_000)
    skipped = Counter()
    keys = [k for batch in eval_batches(cfg, skipped=skipped) for k in batch["keys"]]
    assert "big" not in keys and len(keys) == 11 and skipped == {"corrupt_image": 1}

    from data_pipeline.loader import train_batches

    state = LoaderState()
    for _ in train_batches(cfg, state=state):
        pass
    assert state.skipped == {"corrupt_image": 1}
    assert any("big" in example and "exceed the limit of 10000" in example
               for example in state.skipped_examples), state.skipped_examples


def encoded_as(fmt: str) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (16, 16), (10, 120, 200)).save(out, format=fmt)
    return out.getvalue()


@pytest.mark.parametrize("fmt", ["EPS", "GIF", "BMP", "TIFF", "ICO", "PPM"])
def test_only_jpeg_png_and_webp_are_opened_and_the_refused_format_is_named(fmt):
    with pytest.raises(SkipSample) as skipped:
        decode(encoded_as(fmt), "shard-000000.tar:k1")
    assert skipped.value.detail == (f"shard-000000.tar:k1: format {fmt} is not accepted "
                                    "(send JPEG, PNG or WebP)")
    for fmt_ok in ("JPEG", "PNG", "WEBP"):
        assert decode(encoded_as(fmt_ok), "ok").shape == (3, 16, 16)
    with pytest.raises(SkipSample, match=r"^corrupt_image: x: not a readable JPEG, PNG or "
                                         r"WebP image$"):
        decode(b"\x00" * 64, "x")  # no heap address ("<_io.BytesIO object at 0x...>")


def test_the_loaders_skip_an_eps_sample_naming_its_format(tmp_path):
    eps = Sample("eps", encoded_as("EPS"), "jpg", 1, "a caption")
    write_set(tmp_path, [[digit_sample(i) for i in range(11)] + [eps]])
    cfg = DataConfig(shards=str(tmp_path), batch_size=4, workers=0, resolution=16,
                     shuffle_buffer=4, max_skip_fraction=0.5)
    state = LoaderState()
    from data_pipeline.loader import train_batches

    for _ in train_batches(cfg, state=state):
        pass
    assert state.skipped == {"corrupt_image": 1}
    assert any("eps: format EPS is not accepted" in e for e in state.skipped_examples)


def test_pillow_s_process_wide_limit_is_never_changed(monkeypatch):
    """Opening reads Pillow's limit as it is: nothing a thread could race on is toggled."""
    seen = []
    real_open = Image.open

    def watching(*args, **kwargs):
        seen.append(Image.MAX_IMAGE_PIXELS)
        return real_open(*args, **kwargs)

    monkeypatch.setattr(Image, "open", watching)
    before = Image.MAX_IMAGE_PIXELS
    decode(png(20, 20), "ok", max_pixels=100_000)
    with pytest.raises(SkipSample):
        check_image(bomb_png(30_000, 30_000), "bomb")
    assert seen == [before, before] and Image.MAX_IMAGE_PIXELS == before
