"""Work for the 2-rank gloo group and for the single-process reference: one training
forward/backward through the real engines on a fixed, asymmetric batch, in float64."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from data_pipeline.text import load_tokenizer, tokenize
from pretrain.distributed.deepspeed_engine import DeepSpeedEngine
from pretrain.distributed.engine import Engine, EngineConfig, build_engine, engine_spec
from pretrain.loop.optim import OptimConfig, build_optimizer
from pretrain.loop.step import Objective
from pretrain.loop.trainer import chunked_loss, forward_loss
from pretrain.model.encoder import ModelConfig, build_model
from pretrain.objectives import ObjectiveConfig
from tests.objective_cases import ObjectiveCase
from tests.pretrain.objectives.conftest import make_multiview_batch

NUM_CLASSES = 6  # the batch's labels lie in [0, 6)
SPLIT = 6  # rank 0 holds rows [0, 6), rank 1 rows [6, 19)
# every rank gathers 16 rows (one process: its 19): rank 0 pads 10, rank 1 pads 3
ROWS_PER_RANK = 16
CAPTIONS = ["a photo of the digit zero", "a small dog on grass", "two red apples",
            "a photo of the digit three", "a boat at sea", "a city at night", "an old car",
            "the digit seven, handwritten", "a cat asleep", "snow on a mountain", "a violin"]
MODEL = ModelConfig(backbone="small_cnn", width=8, norm="group", projector_hidden=32,
                    projector_dim=16, projector_bn_out=False)  # independent of the split


BOUNDS = {1: [0, 19], 2: [0, SPLIT, 19], 3: [0, 4, 11, 19], 4: [0, 3, 6, 13, 19]}


def rank_rows(rank: int, world: int) -> slice:
    """The rows of the batch rank ``rank`` of ``world`` holds: uneven, at most
    ``ROWS_PER_RANK`` each."""
    bounds = BOUNDS[world]
    return slice(bounds[rank], bounds[rank + 1])


def training_batch() -> dict[str, Any]:
    """19 rows: 8 images x 2 views + 3 single views, labels with gaps, shuffled; float64."""
    b = make_multiview_batch(seed=3)
    gen = torch.Generator().manual_seed(11)
    images = torch.randn(len(b.ids), 3, 16, 16, generator=gen, dtype=torch.float64)
    return {"images": images, "ids": b.ids, "labels": b.labels,
            "caption_embeddings": b.captions}


def add_tokens(batch: dict[str, Any]) -> None:
    tokens = tokenize(load_tokenizer("bundled"), [CAPTIONS[i] for i in batch["ids"]], 12)
    batch.update(tokens)


def objective_config(name: str, hparams: dict) -> ObjectiveConfig:
    return ObjectiveConfig.of(name, temperature=0.2, learnable_temperature=True, **hparams)


def full_gradients(engine: Engine) -> dict[str, Tensor]:
    """Every parameter's gradient as the engine will apply it (averaged over ranks)."""
    if isinstance(engine, DeepSpeedEngine):
        from deepspeed.utils import safe_get_full_grad

        grads = {name: safe_get_full_grad(p) for name, p in engine.module.named_parameters()}
    else:  # FSDP2's are this rank's shards (DTensors): gathered, on every rank
        grads = {name: full_tensor(p.grad) for name, p in engine.module.named_parameters()}
    return {name: g.detach().double().clone() for name, g in grads.items() if g is not None}


def full_tensor(tensor: Tensor | None) -> Tensor | None:
    """A DTensor's whole value (a collective); a plain tensor as it is."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def run_step(engine_name: str, zero_config: str, case: ObjectiveCase,
             rows: slice | None = None, chunk_size: int = 0,
             checkpointing: str = "none") -> dict[str, Any]:
    """Loss and full parameter gradients of one step on ``rows`` of the batch (the
    rank's own rows under a process group, every row in the reference); with
    ``chunk_size``, through the cached-gradient chunks; ``checkpointing``:
    ``model.activation_checkpointing``."""
    torch.manual_seed(0)
    cfg = objective_config(case.name, case.example)
    model_cfg = dataclasses.replace(MODEL, activation_checkpointing=checkpointing)
    model = build_model(model_cfg, cfg, torch.device("cpu"), NUM_CLASSES).double()
    engine_cfg = EngineConfig(name=engine_name, deepspeed_config=zero_config)
    engine_spec(engine_name).prepare(model, engine_cfg, "fp32")
    optimizer = build_optimizer(model, OptimConfig(name="sgd", lr=0.1), 19)
    engine = build_engine(model, optimizer, engine_cfg, torch.device("cpu"), micro_batch=19)
    batch = training_batch()
    if not case.needs_captions:
        del batch["caption_embeddings"]  # the entry asks for no caption targets
    if case.spec.text_tower:
        add_tokens(batch)
    if rows is None and dist.is_initialized():
        rows = slice(0, SPLIT) if dist.get_rank() == 0 else slice(SPLIT, 19)
    batch = {k: v[rows] for k, v in batch.items()} if rows is not None else batch
    graph = case.keywords(NUM_CLASSES, 16, torch.float64).get("class_graph")
    objective = Objective(cfg, graph, NUM_CLASSES if graph is not None else None, ROWS_PER_RANK)
    if chunk_size:
        out, backward = chunked_loss(engine, batch, objective, step=5, chunk_size=chunk_size)
        backward()
    else:
        out = forward_loss(engine, batch, objective, step=5)
        engine.backward(out.loss)
    return {"loss": out.loss.detach(), "grads": full_gradients(engine)}


def run_step_with_local_gradients(*args: Any) -> dict[str, Any]:
    """:func:`run_step` with a broken gathering boundary: the gather's backward keeps this
    rank's gradient instead of summing every rank's (a subtle 2-rank bug)."""
    from core.collectives import _GatherWithGrad

    def local_only(ctx, grad: Tensor) -> tuple[Tensor, None, None, None]:
        start, stop = ctx.rows
        return grad[start:stop].contiguous(), None, None, None

    original = _GatherWithGrad.backward
    _GatherWithGrad.backward = staticmethod(local_only)
    try:
        return run_step(*args)
    finally:
        _GatherWithGrad.backward = original


def run_step_with_cpu_fp16(fp16_kernels: bool, *args: Any) -> dict[str, Any]:
    """:func:`run_step` with DeepSpeed's CPU accelerator answering ``fp16_kernels`` when
    asked whether this CPU has fp16 kernels (Intel AMX: yes; AMD Zen: no)."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    accelerator.is_fp16_supported = lambda: fp16_kernels
    try:
        return run_step(*args)
    finally:
        del accelerator.is_fp16_supported


def zero3_padding(zero_config: str) -> dict[str, Any]:
    """A ZeRO-3 engine with LARS built while ``torch.empty`` hands out NaN (uninitialised
    memory at its worst), then resumed from its own state read as every rank's partitions
    (the path of a checkpoint of another number of ranks) after each partition's padding
    was set to NaN: after each, whether the padding of this rank's partitions is 0 and its
    fp32 master partitions (what LARS's trust ratio reads whole) are finite, and how many
    padding elements the rank holds."""
    def report() -> dict[str, Any]:
        tails = [p.ds_tensor.data.view(-1)[own_elements(p):] for p in engine.module.parameters()]
        flats = engine.optimizer.fp32_partitioned_groups_flat
        return {"padding": sum(t.numel() for t in tails),
                "zero": all(bool((t == 0).all()) for t in tails),
                "finite": all(bool(torch.isfinite(f).all()) for f in flats)}

    torch.manual_seed(0)
    model = build_model(MODEL, objective_config("infonce", {}), torch.device("cpu"), NUM_CLASSES)
    cfg = EngineConfig(name="deepspeed", deepspeed_config=zero_config)
    optimizer = build_optimizer(model, OptimConfig(name="lars", lr=0.1), 16)
    original = torch.empty
    torch.empty = lambda *a, **k: _filled(original(*a, **k))
    try:
        engine = build_engine(model, optimizer, cfg, torch.device("cpu"), micro_batch=8)
    finally:
        torch.empty = original
    built = report()
    state = engine.state_dict()  # a collective: the model on rank 0
    model_state = [state["model"]]
    dist.broadcast_object_list(model_state, src=0)
    partitions = [None] * dist.get_world_size()
    dist.all_gather_object(partitions, state["optimizer"])
    for p in engine.module.parameters():
        p.ds_tensor.data.view(-1)[own_elements(p):].fill_(float("nan"))
    engine.load_state_dict({"model": model_state[0], "optimizer_partitions": partitions})
    return {"built": built, "resumed": report()}


def own_elements(p: torch.nn.Parameter) -> int:
    """How many elements of its ZeRO-3 partition belong to the parameter on this rank."""
    size = p.partition_numel()
    return min(max(p.ds_numel - dist.get_rank() * size, 0), size)


def _filled(tensor: Tensor) -> Tensor:
    return tensor.fill_(float("nan")) if tensor.is_floating_point() else tensor
