"""The view transforms: the separable blur equals torchvision's, views have the right shape."""

from __future__ import annotations

import pytest
import torch
from torchvision.transforms.v2 import functional as TF

from data_pipeline.transforms import (
    decode,
    decode_size,
    gaussian_blur,
    simclr_view,
    view_transform,
)
from tests.data_pipeline.helpers import digit_jpeg


@pytest.mark.parametrize(("kernel", "sigma"), [(3, 0.1), (7, 1.3), (23, 2.0), (23, 0.4)])
def test_separable_blur_equals_torchvision(kernel, sigma):
    gen = torch.Generator().manual_seed(kernel)
    image = torch.randint(0, 256, (3, 61, 47), generator=gen, dtype=torch.uint8)
    ours = gaussian_blur(image, kernel, sigma)
    theirs = TF.gaussian_blur(image, [kernel, kernel], [sigma, sigma])
    assert ours.dtype == torch.uint8
    assert (ours.int() - theirs.int()).abs().max() <= 1  # rounding of the last bit
    floats = image.float() / 255
    torch.testing.assert_close(gaussian_blur(floats, kernel, sigma),
                               TF.gaussian_blur(floats, [kernel, kernel], [sigma, sigma]),
                               atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", ["simclr", "autoaugment", "none"])
def test_views_have_the_configured_size(kind):
    image = decode(digit_jpeg(3), "test")
    assert image.shape[0] == 3 and image.dtype == torch.uint8
    view = view_transform(kind, 40, 0.2)(image)
    assert view.shape == (3, 40, 40) and view.dtype == torch.float32


def test_views_are_seeded():
    image = decode(digit_jpeg(5), "test")
    view = simclr_view(32)
    torch.manual_seed(3)
    first = view(image)
    torch.manual_seed(3)
    assert torch.equal(view(image), first)


def photo_jpeg(width: int, height: int) -> bytes:
    """A photograph-like JPEG: a digit upsampled with film-grain noise and a tint."""
    import io

    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    base = Image.open(io.BytesIO(digit_jpeg(3))).convert("RGB").resize((width, height))
    pixels = np.asarray(base, dtype=np.int16) + rng.normal(0, 12, (height, width, 3))
    buffer = io.BytesIO()
    Image.fromarray(np.clip(pixels + 40, 0, 255).astype(np.uint8)).save(buffer, "JPEG",
                                                                           quality=90)
    return buffer.getvalue()


def test_draft_decode_keeps_every_crop_at_full_resolution():
    photo = photo_jpeg(1000, 750)
    full = decode(photo, "photo")
    size = decode_size("simclr", 56, 0.08)
    reduced = decode(photo, "photo", size)
    assert full.shape == (3, 750, 1000) and reduced.shape == (3, 375, 500)  # 1/2 per side
    height, width = reduced.shape[1:]
    assert (0.08 * 0.75 * width * height) ** 0.5 >= 56  # the smallest crop still spans 56 px
    assert (0.08 * 0.75 * width * height / 4) ** 0.5 < 56  # 1/4 would not: not chosen
    # a view that needs the full image (crops from 1% of the area) decodes it whole
    assert torch.equal(decode(photo, "photo", decode_size("simclr", 224, 0.01)), full)


def test_draft_decoded_eval_view_matches_the_full_decode():
    photo = photo_jpeg(1000, 750)
    size = decode_size("none", 56, 0.08)
    reduced = decode(photo, "photo", size)
    assert reduced.shape == (3, 94, 125)  # 1/8: the short side still exceeds 56 * 8 / 7
    view = view_transform("none", 56, 0.08)
    std = torch.tensor([0.229, 0.224, 0.225])[:, None, None]
    a = view(decode(photo, "photo")) * std  # back to [0, 1] pixel units
    b = view(reduced) * std
    # libjpeg's DCT scaling against an antialiased resize of the full image: within 1.5
    # grey levels on average (the film grain alone is 12 levels)
    assert (a - b).abs().mean() < 1.5 / 255


def test_draft_decode_leaves_small_and_non_jpeg_images_alone():
    import io

    from PIL import Image

    small = digit_jpeg(5)  # 24 px: smaller than any view
    assert torch.equal(decode(small, "s", decode_size("simclr", 32, 0.3)), decode(small, "s"))
    buffer = io.BytesIO()
    Image.open(io.BytesIO(photo_jpeg(400, 300))).save(buffer, "PNG")
    png = buffer.getvalue()
    assert torch.equal(decode(png, "p", decode_size("none", 32, 0.3)), decode(png, "p"))
