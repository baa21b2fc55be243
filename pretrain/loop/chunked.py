"""Cached-gradient encoder chunks: a batch far larger than activation memory trains with
exactly the full-batch gradient (GradCache: Gao et al. 2021, "Scaling Deep Contrastive
Learning Batch Size under Memory Limited Setup", Sec. 3.2); ``docs/negatives.md``.

1. Embed the batch chunk by chunk without gradient, keeping only the outputs
   (projections [2B, P], the text [2B, P] of clip and siglip, the learnable temperature
   and loss parameters).
2. Compute the objective on those outputs as leaves, against the global batch, and its
   gradient with respect to them (the "representation gradient cache").
3. Re-run each chunk with gradient and back-propagate its slice of the cached gradient,
   as one surrogate sum(output * cached gradient) per chunk.

The pieces follow the loader's chunks (``batch["chunk_sizes"]``: a rank's batch is whole
chunks of ``data.batch_size`` instances, first views then second views): a piece is one
chunk's rows, both views, or a part of them when ``train.chunk_size`` is smaller
(:func:`encoding_pieces`). So with batch norm each piece is its own normalisation batch,
the same rows at any number of ranks, as a rank that holds one chunk normalises it
unchunked. Running statistics follow each rank's first piece alone: rank 0's first piece
is the global batch's first chunk on any world, and its statistics are the ones the
engine keeps (DDP broadcasts rank 0's buffers; checkpoints save rank 0's).

Step 3 replays step 1 exactly: the RNG state (dropout) is restored per piece, and batch
norm computes the same piece statistics while its running statistics, updated in step 1,
are left alone. The engine reduces gradients across ranks once, after the last piece
(DDP ``no_sync`` before it; DeepSpeed's accumulation boundary). Every rank runs as many
pieces (a rank with fewer chunks runs zero-weighted copies); with ``model.norm=group``
chunked and unchunked steps are equal.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from pretrain.distributed.engine_base import Engine
from pretrain.loop.step import model_inputs
from pretrain.model.encoder import ModelOutput
from pretrain.objectives import ObjectiveOutput


def chunks_of(rows: int, count: int) -> list[slice]:
    """``rows`` split into ``count`` nearly equal chunks, smallest (possibly empty) first."""
    sizes = [rows // count + (index >= count - rows % count) for index in range(count)]
    ends = list(itertools.accumulate(sizes))
    return [slice(end - size, end) for size, end in zip(sizes, ends, strict=True)]


def encoding_pieces(chunk_sizes: list[int], splits: int, count: int) -> list[list[int]]:
    """The rows of each piece a rank encodes: chunk j of ``chunk_sizes`` (instances) is
    rows ``[o_j, o_j + n_j)`` (first views) and ``[h + o_j, h + o_j + n_j)`` (second
    views) of a batch of ``h`` instances, cut into ``splits`` nearly equal pieces (smallest,
    possibly empty, first); empty pieces after them make ``count``."""
    total = sum(chunk_sizes)
    pieces: list[list[int]] = []
    start = 0
    for size in chunk_sizes:
        rows = [*range(start, start + size), *range(total + start, total + start + size)]
        pieces += [rows[part] for part in chunks_of(len(rows), splits)]
        start += size
    if len(pieces) > count:
        raise ValueError(f"{len(chunk_sizes)} chunks in {len(pieces)} pieces exceed the "
                         f"{count} pieces every rank encodes")
    return pieces + [[] for _ in range(count - len(pieces))]


def rng_state(device: torch.device) -> tuple[Tensor, Tensor | None]:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def set_rng_state(state: tuple[Tensor, Tensor | None], device: torch.device) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


@contextlib.contextmanager
def batch_stats_frozen(model: nn.Module) -> Iterator[None]:
    """Batch norm in training mode normalises with the batch's statistics but leaves its
    running statistics (and their counter) untouched."""
    norms = [m for m in model.modules()
             if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]
    for norm in norms:
        norm.track_running_stats = False
    try:
        yield
    finally:
        for norm in norms:
            norm.track_running_stats = True


def _cat(parts: list[Tensor | None], inverse: Tensor) -> Tensor | None:
    """The pieces' outputs back in the batch's row order, as one leaf."""
    return None if parts[0] is None else torch.cat(parts)[inverse].requires_grad_()


def _leaf(value: Tensor | None) -> Tensor | None:
    return None if value is None else value.detach().requires_grad_()


def _leaf_grads(loss: Tensor, leaves: ModelOutput) -> ModelOutput:
    """The gradient of ``loss`` at each leaf of ``leaves``, in the same structure."""
    flat = [leaves.projections, leaves.text, leaves.temperature,
            *leaves.loss_parameters.values()]
    wanted = [t for t in flat if t is not None]
    found = iter(torch.autograd.grad(loss, wanted))
    grads = [None if t is None else next(found) for t in flat]
    return ModelOutput(None, grads[0], grads[1], grads[2],
                       dict(zip(leaves.loss_parameters, grads[3:], strict=True)))


def _surrogate(out: ModelOutput, grads: ModelOutput, rows: Tensor, last: bool) -> Tensor:
    """sum(output * cached gradient) of one chunk: its rows of the projections (and text);
    the whole gradient of the temperature and loss parameters once, with the last chunk."""
    surrogate = (out.projections * grads.projections[rows]).sum()
    if out.text is not None:
        surrogate = surrogate + (out.text * grads.text[rows]).sum()
    if out.temperature is not None:
        surrogate = surrogate + out.temperature * grads.temperature * last
    for name, value in out.loss_parameters.items():
        surrogate = surrogate + (value * grads.loss_parameters[name]).sum() * last
    return surrogate


def chunked_forward_loss(engine: Engine, batch: dict[str, Any],
                         loss_of: Callable[[ModelOutput], ObjectiveOutput], chunk_size: int,
                         rows_per_rank: int | None = None,
                         pieces: tuple[int, int] | None = None,
                         ) -> tuple[ObjectiveOutput, Callable[[], None]]:
    """``loss_of`` (the step's objective against the global batch) on the whole batch's
    outputs, made piece by piece without gradient, and the function that back-propagates
    it through the encoder piece by piece (steps 1-3 above). ``pieces``: (pieces a chunk
    of ``batch["chunk_sizes"]`` is cut in, pieces every rank encodes); None: the batch is
    one chunk, cut in pieces of at most ``chunk_size`` rows, as many as the most rows a
    rank holds need (``rows_per_rank``). The caller decides, from the loss, whether to
    call the backward (the non-finite guard)."""
    device = batch["images"].device
    rows_here = len(batch["images"])
    sizes = batch.get("chunk_sizes") or []
    if pieces is None:
        splits = count = max(1, math.ceil((rows_per_rank or rows_here) / chunk_size))
    else:
        splits, count = pieces
    if pieces is None or 2 * sum(sizes) != rows_here:  # one chunk, or a placeholder's rows
        rows = list(range(rows_here))
        cut = [rows[part] for part in chunks_of(rows_here, splits)]
        cut += [[] for _ in range(count - len(cut))]
    else:
        cut = encoding_pieces(sizes, splits, count)
    pieces_rows = [torch.tensor(rows, dtype=torch.long, device=device) for rows in cut]
    # An empty piece's rows: a copy of two real rows, weighted zero; under SyncBatchNorm
    # (GPUs), whose every forward is a collective, no row at all, so that it adds nothing
    # to the other ranks' statistics (never run on a GPU)
    synced = any(isinstance(m, nn.SyncBatchNorm) for m in engine.module.modules())
    stand_in = torch.arange(0 if synced else min(2, rows_here), device=device)
    states, outputs = [], []
    with torch.no_grad():
        for index, rows in enumerate(pieces_rows):
            states.append(rng_state(device))
            # running statistics: the first piece's alone (see the module's docstring)
            frozen = batch_stats_frozen(engine.module) if index else contextlib.nullcontext()
            with frozen:
                if len(rows):
                    outputs.append(engine.module(*model_inputs(batch, rows)))
                elif synced or engine.shards_parameters:  # a collective: every rank joins
                    with batch_stats_frozen(engine.module):
                        engine.module(*model_inputs(batch, stand_in))
    after = rng_state(device)
    inverse = torch.argsort(torch.cat([rows for rows in pieces_rows if len(rows)]))
    leaves = ModelOutput(
        features=None if outputs[0].features is None else torch.cat(
            [o.features for o in outputs])[inverse],  # no gradient: watched, not trained
        projections=_cat([o.projections for o in outputs], inverse),
        text=_cat([o.text for o in outputs], inverse),
        temperature=_leaf(outputs[0].temperature),
        loss_parameters={name: _leaf(value)
                         for name, value in outputs[0].loss_parameters.items()})
    result = loss_of(leaves)
    autocast = (torch.is_autocast_enabled(device.type), torch.get_autocast_dtype(device.type))

    def backward() -> None:
        grads = _leaf_grads(result.loss, leaves)
        with batch_stats_frozen(engine.module):
            for index, rows in enumerate(pieces_rows):
                last = index == len(pieces_rows) - 1
                set_rng_state(states[index], device)
                # A rank with fewer rows than pieces runs a zero-weighted copy of a real
                # piece: ZeRO-2 needs every rank's gradients ready in the same order.
                weight = 1.0 if len(rows) else 0.0
                rows = rows if len(rows) else stand_in
                with engine.accumulating(last):
                    with torch.autocast(device.type, dtype=autocast[1], enabled=autocast[0]):
                        out = engine(*model_inputs(batch, rows))
                    engine.backward(_surrogate(out, grads, rows, last) * weight)
        set_rng_state(after, device)

    return result, backward
