"""Tiled objectives equal the dense ones, and no [n, N] tensor exists while they run.

Float64 throughout, so values and gradients must agree to rounding (the tiles only
reorder sums). Tile widths that do not divide N leave a short last tile; width 1 is every
column on its own.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from pretrain.contrast import rows as row_reductions
from pretrain.contrast import tiles
from pretrain.contrast.batch import ContrastiveBatch, auto_tile_size
from pretrain.objectives import batch_loss, objective_function
from tests.objective_cases import ObjectiveCase, case_ids, objective_cases
from tests.pretrain.objectives.batches import FreshAllocations, batch_of
from tests.pretrain.objectives.conftest import Batch, make_multiview_batch

CASES = objective_cases()
IDS = case_ids(CASES)


def inputs(b: Batch, case: ObjectiveCase) -> tuple[dict, list[torch.Tensor]]:
    """Keyword arguments of ``batch_loss`` and the extra leaves to differentiate: the
    second modality's embeddings and the loss parameters, made leaves."""
    rows = case.rows(b.z, b.ids, b.labels, b.captions, b.text)
    kwargs = case.keywords(6, b.z.shape[1], torch.float64)
    leaves = case.parameter_leaves(kwargs)
    if rows.text is not None:
        kwargs["text"] = rows.text.clone().requires_grad_()
        leaves.insert(0, kwargs["text"])
    return {"labels": rows.labels, "captions": rows.captions, **kwargs}, leaves


@pytest.fixture(params=[False, True], ids=["one-row-block", "row-blocks-of-3"])
def row_blocks(request, monkeypatch) -> None:
    """Also cut the anchors into blocks of 21 // T rows, as a CPU cuts large n."""
    if request.param:
        monkeypatch.setattr(tiles, "CPU_BLOCK_ELEMENTS", 3 * 7)


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("num_negatives", [None, 5])
@pytest.mark.parametrize("tile_size", [1, 4, 7])
def test_tiled_equals_dense(case, num_negatives, tile_size, row_blocks):
    b = make_multiview_batch(seed=2)
    kwargs, leaves = inputs(b, case)
    results = []
    for width in (None, tile_size):
        tau = torch.tensor(0.2, dtype=torch.float64, requires_grad=True)  # learnable
        loss, metrics = batch_loss(case.name, b.z, b.ids, temperature=tau, tile_size=width,
                                   num_negatives=num_negatives, negatives_seed=3, **kwargs)
        results.append((loss, metrics, torch.autograd.grad(loss, [b.z, tau, *leaves])))
    (dense, dense_metrics, dense_grads), (tiled, tiled_metrics, tiled_grads) = results
    torch.testing.assert_close(tiled, dense, rtol=1e-12, atol=1e-12)
    assert tiled_metrics.keys() == dense_metrics.keys()
    for key, value in dense_metrics.items():
        torch.testing.assert_close(tiled_metrics[key], value, rtol=1e-10, atol=1e-12, msg=key)
    for got, want in zip(tiled_grads, dense_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("ranged", [False, True], ids=["gathered", "ranged"])
@pytest.mark.parametrize("num_negatives", [None, 5])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_tiled_rank_slices_average_to_the_whole_batch(case, num_negatives, row_blocks, ranged):
    """The distributed arithmetic (rows of one rank against all columns) with tiles on;
    ``ranged``: each rank's anchors are a range of the candidates (``anchor_start``), as
    the gathering boundary makes them, so the tiled pass takes them as those rows."""
    b = make_multiview_batch(seed=4)
    kwargs, _ = inputs(b, case)
    objective = objective_function(case.name, **{k: v for k, v in kwargs.items()
                                       if k not in ("labels", "text", "captions",
                                                    "class_graph")})
    tau = torch.tensor(0.2, dtype=torch.float64, requires_grad=True)
    whole = objective(batch_of(b.z, b.ids, labels=kwargs["labels"],
                               captions=kwargs.get("captions"),
                               class_graph=kwargs.get("class_graph"), text=b.text,
                                 num_negatives=num_negatives, negatives_seed=7), tau)
    want = torch.autograd.grad(whole.loss, [b.z, tau])
    slices = [torch.arange(0, 6), torch.arange(6, 19)]
    loss, grads = 0.0, [torch.zeros_like(b.z), torch.zeros_like(tau)]
    captions = kwargs.get("captions")
    for rows in slices:
        local = ContrastiveBatch(
            candidates=F.normalize(b.z, dim=1), anchor_index=rows, ids=b.ids,
            labels=kwargs["labels"],
            captions=None if captions is None else F.normalize(captions, dim=1),
            class_graph=kwargs.get("class_graph"), text=F.normalize(b.text, dim=1),
            num_negatives=num_negatives, negatives_seed=7, tile_size=5, world_size=2,
            anchor_start=int(rows[0]) if ranged else None)
        out = objective(local, tau)
        loss = loss + out.loss / 2
        for acc, g in zip(grads, torch.autograd.grad(out.loss, [b.z, tau]), strict=True):
            acc += g / 2
    torch.testing.assert_close(loss, whole.loss, rtol=1e-12, atol=1e-12)
    for got, expected in zip(grads, want, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)


class LargestOutput(TorchDispatchMode):
    """Records the largest number of elements any operator produced."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0
        self.op = ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor) and t.numel() > self.largest:
                self.largest, self.op = t.numel(), str(func)
        return out


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("num_negatives", [None, 9])
def test_no_tensor_of_anchors_by_candidates(case, num_negatives):
    """Forward and backward with tiles of 8 over N = 192 candidates: no operator output
    reaches n * N / 8 elements (a dense run makes [n, N] ones: the probe works). ProjNCE
    gets the number of classes, as a run gives it (its class posterior is [N, C])."""
    gen = torch.Generator().manual_seed(0)
    n, dim = 192, 6
    ids = torch.arange(n // 2).repeat_interleave(2)
    b = Batch(z=torch.randn(n, dim, dtype=torch.float64, generator=gen).requires_grad_(),
              ids=ids, labels=ids % 6,
              captions=torch.randn(n // 2, 5, dtype=torch.float64, generator=gen)[ids],
              text=torch.randn(n, dim, dtype=torch.float64, generator=gen))
    kwargs, leaves = inputs(b, case)
    if "bandwidth" in kwargs:
        kwargs["bandwidth"] = 0.3
    if kwargs["labels"] is not None:  # label groups are the classes, as a run gives them
        kwargs["num_classes"] = 6
    limit = n * n // 8
    sizes = {}
    for width in (None, 8):
        probe = LargestOutput()
        with probe:
            loss, _ = batch_loss(case.name, b.z, b.ids, temperature=0.3, tile_size=width,
                                 num_negatives=num_negatives, **kwargs)
            torch.autograd.grad(loss, [b.z, *leaves])
        sizes[width] = (probe.largest, probe.op)
    assert sizes[None][0] >= n * n, sizes  # dense materialises [n, N]
    assert sizes[8][0] < limit, sizes


def test_auto_tile_size_is_dense_for_small_batches():
    assert auto_tile_size(None, 512) is None
    assert auto_tile_size(None, 10**6) is not None
    assert auto_tile_size(64, 512) == 64


BUFFER_CASES = [ObjectiveCase(name, {}) for name in ("infonce", "supcon", "xclr", "sincere",
                                                     "clip")]


@pytest.mark.parametrize("case", BUFFER_CASES, ids=case_ids(BUFFER_CASES))
def test_tile_buffers_are_allocated_once_per_pass(case):
    """Forward and backward with tiles of 8 allocate their [rows, 8] float tiles once per
    pass, whatever the number of tiles: a fresh tile per tile leaves freed blocks that
    glibc keeps resident (the peak memory of docs/benchmarks.md)."""
    counts = {}
    for n in (96, 192):  # 12 and 24 tiles of one row block
        gen = torch.Generator().manual_seed(0)
        ids = torch.arange(n // 2).repeat_interleave(2)
        b = Batch(z=torch.randn(n, 6, dtype=torch.float64, generator=gen).requires_grad_(),
                  ids=ids, labels=ids % 6,
                  captions=torch.randn(n // 2, 5, dtype=torch.float64, generator=gen)[ids],
                  text=torch.randn(n, 6, dtype=torch.float64, generator=gen))
        kwargs, _ = inputs(b, case)
        probe = FreshAllocations(numel=n * 8)
        with probe:
            loss, _ = batch_loss(case.name, b.z, b.ids, temperature=0.3, tile_size=8,
                                 **kwargs)
            loss.backward()
        counts[n] = probe.count
    # the forward's and backward's buffers (SINCERE: its pair tiles' too), each one [rows, 8]
    assert counts[96] == counts[192] <= 14, counts


@pytest.mark.parametrize("walk", ["row-walk", "symmetric"])
def test_tiled_xclr_copies_no_more_than_a_row_block_of_captions(walk, monkeypatch):
    """Caption targets normalise the anchors' captions a block of rows at a time and scale
    each tile's columns by their inverse norms: no [n, E] or [N, E] copy (at E = 384 one
    outweighs the [N, D] embeddings three times, docs/negatives.md). Every row an anchor,
    the pairs of tiles are walked once (``symmetric_tiles.py``); a rank's share of the
    rows walks its rows against every column."""
    n, width = 64, 7
    monkeypatch.setattr(tiles, "CPU_BLOCK_ELEMENTS", 16 * 16)
    tile_size = 16  # row blocks of 16 rows; square tiles of 16 x 16
    if walk == "row-walk":
        monkeypatch.setattr(row_reductions, "transposable", lambda batch: False)
    gen = torch.Generator().manual_seed(0)
    ids = torch.arange(n // 2).repeat(2)
    z = torch.randn(n, 3, dtype=torch.float64, generator=gen).requires_grad_()
    captions = torch.randn(n // 2, width, dtype=torch.float64, generator=gen)[ids]
    probe = FreshAllocations(numel=(n // 2) * width, width=width)
    with probe:
        loss, _ = batch_loss("xclr", z, ids, captions=captions, temperature=0.3,
                             tile_size=tile_size)
        loss.backward()
    assert probe.shapes == [], probe.shapes
    small = FreshAllocations(numel=16 * width, width=width)  # the row blocks are there
    with small:
        batch_loss("xclr", z, ids, captions=captions, temperature=0.3, tile_size=tile_size)
    assert small.shapes == [(16, width)] * 4, small.shapes
