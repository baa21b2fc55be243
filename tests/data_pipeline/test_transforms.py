"""The view transforms: the separable blur equals torchvision's, views have the right shape."""

from __future__ import annotations

import pytest
import torch
from torchvision.transforms.v2 import functional as TF

from data_pipeline.transforms import decode, gaussian_blur, simclr_view, view_transform
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
