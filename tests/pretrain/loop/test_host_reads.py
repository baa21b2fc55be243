"""No training step reads a value back from the device, for any objective, at any world
size: a step's forward and backward (model, gathering boundary with an uneven split,
objective, finite flag, metric window) on fake CUDA tensors in a 2-rank CUDA-only process
group, with every value-dependent shape refused (``tests/cuda_dry_run.py``). On a GPU
each such read would stall the host until the device caught up, then idle the device
while the host prepared the next step; here each raises.

Variants: dense, tiled, with a negatives subset, both, and encoded in chunks (cached
gradients); X-CLR from the class graph and from captions; ProjNCE with each projection.
Under ``engine.name=fsdp2`` the same step on a hybrid ViT sharded per block with
activation checkpointing: the sharding, the parameter gathers and (on the CPU) the
gradient reduce-scatter, clipping and the masked update; FSDP2's CUDA streams become
no-op stand-ins (``driverless_streams``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import NamedTuple

import pytest
import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
)
from torch.distributed.tensor import DTensor

import pretrain.loop.chunked as chunked
from core.runtime import autocast
from pretrain.distributed.engine import EngineConfig, FSDP2Engine, build_engine, engine_spec
from pretrain.loop.device_metrics import MetricWindow, agreed_flags
from pretrain.loop.optim import OptimConfig, build_optimizer
from pretrain.loop.step import Objective
from pretrain.loop.trainer import chunked_loss, forward_loss
from pretrain.model.encoder import ModelConfig, build_model
from pretrain.model.text_tower import TextTowerConfig
from pretrain.objectives import ObjectiveConfig
from tests.cuda_dry_run import cuda_world, driverless_streams, fake_cuda, fake_mesh
from tests.objective_cases import ObjectiveCase, case_ids, objective_cases

CUDA = torch.device("cuda")
IMAGES = 3  # this rank's images (two views each): 6 rows, padded to ROWS_PER_RANK
ROWS_PER_RANK = 8
CLASSES = 3
VARIANTS = {"dense": {}, "tiled": {"tile_size": 4}, "negatives": {"num_negatives": 3},
            "tiled-negatives": {"tile_size": 4, "num_negatives": 3}, "chunked": {}}
SMALL_CNN = ModelConfig(width=8, projector_hidden=32, projector_dim=16, sync_batchnorm=False)
SHARDED_VIT = ModelConfig(backbone="timm:vit_tiny_patch16_224", image_size=16, patch_size=8,
                          vit_stem="hybrid", width=8, norm="group", projector_hidden=32,
                          projector_dim=16, projector_bn_out=False, sync_batchnorm=False,
                          activation_checkpointing=2,
                          timm_kwargs={"depth": 3, "embed_dim": 32, "num_heads": 2})
OBJECTIVE_CASES = objective_cases()


def device_batch(case: ObjectiveCase, device: torch.device) -> dict[str, torch.Tensor]:
    rows = 2 * IMAGES
    batch = {"images": torch.randn(rows, 3, 16, 16, device=device),
             "ids": torch.arange(IMAGES, device=device).repeat(2),
             "labels": torch.arange(rows, device=device) % CLASSES}
    if case.needs_captions:
        batch["caption_embeddings"] = torch.randn(IMAGES, 12, device=device).repeat(2, 1)
    if case.spec.text_tower:
        batch["input_ids"] = torch.randint(0, 100, (IMAGES, 6), device=device).repeat(2, 1)
        batch["attention_mask"] = torch.ones(rows, 6, dtype=torch.long, device=device)
    return batch


def no_cuda_rng(monkeypatch: pytest.MonkeyPatch) -> None:
    """The chunked step saves and restores the CUDA generator (a driver call): a stand-in."""
    monkeypatch.setattr(chunked, "rng_state", lambda device: (torch.get_rng_state(), None))
    monkeypatch.setattr(chunked, "set_rng_state", lambda state, device: None)


class PlainEngine(torch.nn.Module):
    """The engine calls the chunked step makes, without DDP (it cannot wrap fake
    parameters): the model's forward, its backward, no gradient accumulation guard."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.module = model

    def forward(self, *inputs):
        return self.module(*inputs)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def accumulating(self, last: bool):
        return contextlib.nullcontext()


class Step(NamedTuple):
    """One step's setting: the objective case, the variant, the engine and the device."""

    case: ObjectiveCase
    variant: str
    engine: str  # "ddp" (the model as it is: DDP cannot wrap fake parameters) or "fsdp2"
    device: torch.device


def build_fsdp2(model: torch.nn.Module) -> FSDP2Engine:
    """The model sharded and trained as ``engine.name=fsdp2`` does, AdamW with clipping."""
    cfg = EngineConfig(name="fsdp2", gradient_clipping=0.5)
    engine_spec("fsdp2").prepare(model, cfg, "bf16")
    optimizer = build_optimizer(model, OptimConfig(name="adamw", lr=1e-3), 2 * IMAGES)
    return build_engine(model, optimizer, cfg, next(model.parameters()).device, 2 * IMAGES)


def train_step(setting: Step, monkeypatch: pytest.MonkeyPatch,
               random_text: TextTowerConfig) -> list[str]:
    """One step on rank 0 of 2 on fake tensors of the setting's device: forward, finite
    flag and metric window; on the CPU the backward too (the autograd engine wants a CUDA
    driver for CUDA tensors, fake or not), and under FSDP2 the update. Returns the
    collectives that ran."""
    case, device = setting.case, setting.device
    cfg = ObjectiveConfig.of(case.name, learnable_temperature=case.spec.text_tower,
                             **VARIANTS[setting.variant], **case.example)
    model_cfg = dataclasses.replace(SHARDED_VIT if setting.engine == "fsdp2" else SMALL_CNN,
                                    text=random_text)
    model = build_model(model_cfg, cfg, torch.device("cpu"), num_classes=CLASSES).train()
    no_cuda_rng(monkeypatch)
    with cuda_world(world=2, rank=0, backend=f"{device.type}:fake"), \
            fake_mesh(2, device.type), driverless_streams(), \
            fake_cuda(value_dependent_shapes=False, device_type=device.type) as ran:
        model = model.to(device, copy=True)
        if device.type == "cuda":  # autocast turns itself off without a driver; it asks these
            monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
            monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True)
        engine = build_fsdp2(model) if setting.engine == "fsdp2" else PlainEngine(model)
        graph = torch.rand(CLASSES, CLASSES, device=device) if case.class_graph else None
        objective = Objective(cfg, graph, CLASSES, ROWS_PER_RANK)
        batch = device_batch(case, device=device)
        with autocast("bf16", device):
            if setting.variant == "chunked":
                out, backward = chunked_loss(engine, batch, objective, 3, chunk_size=4)
            else:
                out = forward_loss(engine, batch, objective, 3)
                backward = out.loss.backward
        flags = agreed_flags(out.loss)
        if device.type == "cpu":
            backward()
            if setting.engine == "fsdp2":
                engine.step(skip=~flags.update)
                assert all(isinstance(p, DTensor) for p in model.parameters())
        window = MetricWindow()
        window.add(out.metrics, flags.real)
        assert out.loss.device.type == device.type
    return ran.ran


@pytest.mark.parametrize("device", ["cuda", "cpu"])
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("case", OBJECTIVE_CASES, ids=case_ids(OBJECTIVE_CASES))
def test_a_training_step_reads_no_value_back_from_the_device(case, variant, device,
                                                             monkeypatch, random_text):
    ran = train_step(Step(case, variant, "ddp", torch.device(device)), monkeypatch,
                     random_text)
    assert "c10d.allgather_.default" in ran  # the global batch went through the group


@pytest.mark.parametrize("variant,device", [("dense", "cuda"), ("dense", "cpu"),
                                            ("chunked", "cpu")])
@pytest.mark.parametrize("case", OBJECTIVE_CASES, ids=case_ids(OBJECTIVE_CASES))
def test_an_fsdp2_step_reads_no_value_back_from_the_device(case, variant, device,
                                                           monkeypatch, random_text):
    ran = train_step(Step(case, variant, "fsdp2", torch.device(device)), monkeypatch,
                     random_text)
    assert "c10d._allgather_base_.default" in ran  # FSDP2 gathered the parameters
    if device == "cpu":
        assert "c10d._reduce_scatter_base_.default" in ran  # and reduced the gradients


def test_a_read_of_a_value_fails_the_check():
    """The check works: a count read back (``int``), a value-dependent shape (``unique``)
    and a comparison answered on the host (``torch.equal``) each raise."""
    with cuda_world(), fake_cuda(value_dependent_shapes=False):
        labels = torch.arange(6, device=CUDA) % 3
        with pytest.raises(DataDependentOutputException):
            int(labels.max())
        with pytest.raises(DynamicOutputShapeException):
            torch.unique(labels)
        with pytest.raises(DataDependentOutputException):
            torch.equal(labels, labels)
