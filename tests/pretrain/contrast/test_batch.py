"""The batch's unit rows against torch's F.normalize, whose backward it replaces."""

import pytest
import torch
import torch.nn.functional as F

from pretrain.contrast.batch import unit_rows
from tests.pretrain.objectives.batches import FreshAllocations


def rows_with_a_zero_and_a_tiny_one(dtype: torch.dtype) -> torch.Tensor:
    x = torch.randn(7, 5, dtype=dtype, generator=torch.Generator().manual_seed(0))
    x[2] = 0.0  # a padding row
    x[4] *= 1e-14  # below the norm clamp
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_unit_rows_are_f_normalize_bit_for_bit(dtype):
    x = rows_with_a_zero_and_a_tiny_one(dtype)
    assert torch.equal(unit_rows(x), F.normalize(x, dim=1))


def test_unit_rows_gradient_is_f_normalize_gradient():
    x = rows_with_a_zero_and_a_tiny_one(torch.float64).requires_grad_()
    grad = torch.randn(7, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    ours, = torch.autograd.grad(unit_rows(x), x, grad)
    theirs, = torch.autograd.grad(F.normalize(x, dim=1), x, grad)
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=0)


def test_unit_rows_gradient_passes_gradcheck():
    x = torch.randn(4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    assert torch.autograd.gradcheck(unit_rows, (x.requires_grad_(),))


def test_unit_rows_backward_allocates_one_n_by_d_tensor():
    """F.normalize's backward walks the division and the norm (eight [N, D] tensors with
    torch 2.15); this one writes the input's gradient and nothing else of its size (the
    tiled peaks of docs/benchmarks.md)."""
    x = torch.randn(64, 8, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(64, 8, dtype=torch.float64)
    counts = []
    for normalize in (unit_rows, lambda t: F.normalize(t, dim=1)):
        y = normalize(x)
        probe = FreshAllocations(numel=x.numel())
        with probe:
            y.backward(grad)
        counts.append(probe.count)
    assert counts[0] == 1 < counts[1], counts
