"""Cached-gradient chunks (``train.chunk_size``) give exactly the full-batch loss and
gradient: one process and 2 gloo ranks under DDP, ZeRO-1, ZeRO-2 and FSDP2, against the
unchunked step; batch norm and dropout replay their first pass; peak memory falls with the
chunk."""

from __future__ import annotations

import contextlib

import pytest
import torch

from bench.common import peak_memory_bytes
from pretrain.loop.chunked import batch_stats_frozen, chunks_of
from pretrain.loop.step import Objective, model_inputs
from pretrain.loop.trainer import chunked_loss, loss_of_outputs
from pretrain.model.encoder import ModelConfig, ModelOutput, build_model
from pretrain.objectives import ObjectiveConfig
from tests.objective_cases import ObjectiveCase, case_ids, objective_cases
from tests.pretrain.distributed import engine_tasks
from tests.pretrain.distributed.test_engine import ENGINES, tolerance

pytestmark = pytest.mark.long_file  # collected first: tests/conftest.py

CASES = objective_cases()
IDS = case_ids(CASES)
# the two-rank checks: a softmax over one modality, soft targets, both image-text losses
TWO_RANKS = [ObjectiveCase("infonce", {}), ObjectiveCase("xclr", {}), ObjectiveCase("clip", {}),
             ObjectiveCase("siglip", {"bias": -2.0})]


def assert_same_step(got: dict, want: dict, engine: str = "ddp") -> None:
    torch.testing.assert_close(got["loss"], want["loss"], rtol=0, atol=1e-12)
    assert set(got["grads"]) == set(want["grads"])
    for key, grad in want["grads"].items():
        torch.testing.assert_close(got["grads"][key], grad, rtol=0,
                                   atol=tolerance(engine, grad), msg=key)


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("chunk_size", [1, 4, 19])
def test_chunked_equals_unchunked(case, chunk_size):
    """Float64, a split-independent encoder (group norm), learnable temperature."""
    whole = engine_tasks.run_step("ddp", "", case, rows=slice(None))
    chunked = engine_tasks.run_step("ddp", "", case, rows=slice(None), chunk_size=chunk_size)
    assert_same_step(chunked, whole)


# ZeRO-3 in chunks: test_two_ranks_checkpointed_and_chunked_equal_one_process and
# test_a_rank_with_fewer_rows_than_chunks_keeps_the_engine_in_step
CHUNKED = {k: v for k, v in ENGINES.items() if k != "zero3"}


@pytest.mark.parametrize(("engine", "zero"), list(CHUNKED.values()), ids=list(CHUNKED))
@pytest.mark.parametrize("case", TWO_RANKS, ids=case_ids(TWO_RANKS))
def test_two_ranks_chunked_equal_one_process(gloo2, engine, zero, case):
    """Ranks of 6 and 13 rows in chunks of 4: the engines reduce the accumulated
    gradient to the single-process full-batch one."""
    ranks = gloo2.run(engine_tasks.run_step, engine, zero, case, None, 4)
    whole = engine_tasks.run_step("ddp", "", case, rows=slice(None))
    torch.testing.assert_close(sum(r["loss"] for r in ranks) / 2, whole["loss"], rtol=0,
                               atol=1e-12)
    for rank in ranks:
        assert_same_step({**rank, "loss": whole["loss"]}, whole, engine)


@pytest.mark.parametrize(("engine", "zero"), [ENGINES["ddp"], ENGINES["zero3"]],
                         ids=["ddp", "zero3"])
@pytest.mark.parametrize("case", [TWO_RANKS[0], TWO_RANKS[2]], ids=["infonce", "clip"])
def test_two_ranks_checkpointed_and_chunked_equal_one_process(gloo2, engine, zero, case):
    """Activation checkpointing inside DDP, or ZeRO-3 (whose hooks gather a block's
    parameters again for its recomputed forward), and the cached-gradient chunks (whose
    second pass is the checkpointed forward's first): the plain single-process gradient."""
    ranks = gloo2.run(engine_tasks.run_step, engine, zero, case, None, 4, "full")
    whole = engine_tasks.run_step("ddp", "", case, rows=slice(None))
    for rank in ranks:
        assert_same_step({**rank, "loss": whole["loss"]}, whole, engine)


def bn_model(dropout: float = 0.0) -> tuple[torch.nn.Module, ObjectiveConfig]:
    cfg = ObjectiveConfig(name="infonce", temperature=0.2)
    model = build_model(ModelConfig(width=8, projector_hidden=32, projector_dim=16), cfg,
                        torch.device("cpu")).double()
    if dropout:
        model.encoder.projector.insert(3, torch.nn.Dropout(dropout))
    return model, cfg


def naive_chunks(model, batch, cfg, chunk_size):
    """Every chunk forward with gradient, kept in one graph, the running statistics moved
    by the first chunk alone: the reference of what the chunked step's two passes must
    reproduce."""
    rows = len(batch["ids"])
    outs = []
    for index, part in enumerate(chunks_of(rows, -(-rows // chunk_size))):
        with batch_stats_frozen(model) if index else contextlib.nullcontext():
            outs.append(model(*model_inputs(batch, part)))
    whole = ModelOutput(None, torch.cat([o.projections for o in outs]), None, None, {})
    out = loss_of_outputs(whole, batch, Objective(cfg), step=0)
    out.loss.backward()
    return out.loss


@pytest.mark.parametrize("dropout", [0.0, 0.3], ids=["batchnorm", "batchnorm+dropout"])
def test_batch_norm_and_dropout_replay_the_first_pass(dropout):
    """With batch norm each chunk is its own normalisation batch: the chunked gradient is
    the gradient of that loss, and the running statistics move with the first chunk (the
    one rank 0 keeps on any world: ``chunked.py``). Dropout
    masks replay: without the RNG restore the second pass would differ."""
    batch = engine_tasks.training_batch()
    results = []
    for chunked in (False, True):
        torch.manual_seed(0)
        model, cfg = bn_model(dropout)
        torch.manual_seed(1)
        if chunked:
            engine = engine_tasks.build_engine(
                model, torch.optim.SGD(model.parameters(), lr=0.1),
                engine_tasks.EngineConfig(), torch.device("cpu"), micro_batch=19)
            out, backward = chunked_loss(engine, batch, Objective(cfg), 0, chunk_size=5)
            backward()
            loss = out.loss
        else:
            loss = naive_chunks(model, batch, cfg, 5)
        results.append((loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters()},
                        {k: b.clone() for k, b in model.named_buffers()}))
    (loss, grads, buffers), (chunk_loss, chunk_grads, chunk_buffers) = results
    torch.testing.assert_close(chunk_loss, loss, rtol=0, atol=1e-12)
    for key, grad in grads.items():
        torch.testing.assert_close(chunk_grads[key], grad, rtol=1e-10, atol=1e-12, msg=key)
    for key, buffer in buffers.items():  # running statistics: the first chunk's update
        torch.testing.assert_close(chunk_buffers[key], buffer, rtol=1e-12, atol=0, msg=key)


def test_peak_memory_falls_with_the_chunk_size():
    """64 images of 32 px: chunks of 8 hold a fraction of the activations of one chunk of
    64 (the embeddings and their cached gradient are all that spans the batch)."""
    cfg = ObjectiveConfig(name="infonce", temperature=0.2)
    model = build_model(ModelConfig(width=16, projector_hidden=64, projector_dim=16), cfg,
                        torch.device("cpu"))
    engine = engine_tasks.build_engine(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                       engine_tasks.EngineConfig(), torch.device("cpu"), 64)
    gen = torch.Generator().manual_seed(0)
    batch = {"images": torch.randn(64, 3, 32, 32, generator=gen),
             "ids": torch.arange(32).repeat(2)}

    def step(chunk_size: int):
        def run() -> None:
            out, backward = chunked_loss(engine, batch, Objective(cfg), 0, chunk_size)
            backward()
            model.zero_grad(set_to_none=True)
        return run

    peaks = {size: peak_memory_bytes(step(size), torch.device("cpu")) for size in (64, 8)}
    assert peaks[8] < 0.4 * peaks[64], peaks


@pytest.mark.parametrize(("engine", "zero"), [ENGINES[k] for k in ("zero2", "zero3", "fsdp2")],
                         ids=["zero2", "zero3", "fsdp2"])
def test_a_rank_with_fewer_rows_than_chunks_keeps_the_engine_in_step(gloo2, engine, zero):
    """Chunks of 2: 7 per rank, so the 6-row rank has one empty chunk (it runs a
    zero-weighted copy of a real one) and both ranks reduce the same gradients in the same
    order (without the copy, ZeRO-2 pairs up the wrong gradients); under FSDP2, whose every
    forward gathers parameters, it also runs the no-gradient pass of that chunk."""
    ranks = gloo2.run(engine_tasks.run_step, engine, zero, TWO_RANKS[0], None, 2)
    whole = engine_tasks.run_step("ddp", "", TWO_RANKS[0], rows=slice(None))
    for rank in ranks:
        assert_same_step({**rank, "loss": whole["loss"]}, whole, engine)
