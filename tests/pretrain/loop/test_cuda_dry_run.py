"""A training step's forward on a CUDA device in a 2-rank CUDA-only process group, dry run
on the CPU (``tests/cuda_dry_run.py``): the model built on the device, the encoder under
bf16 autocast, the gathering boundary, every objective dense and tiled, with all negatives
and a subset, the finite-loss flag and the metric window; and every scalar collective the
trainer, the checkpointer and the metrics use. A CPU tensor handed to a collective or mixed
with a CUDA tensor fails these tests (the last test shows it)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch._subclasses.fake_tensor import DataDependentOutputException
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

import core.collectives as collectives
from core.runtime import autocast
from pretrain.loop.device_metrics import MetricWindow, finite_on_every_rank
from pretrain.loop.step import Objective
from pretrain.loop.trainer import forward_loss
from pretrain.model.encoder import ModelConfig, build_model
from pretrain.objectives import ObjectiveConfig
from tests.cuda_dry_run import cuda_world, fake_cuda
from tests.objective_cases import ObjectiveCase, case_ids, objective_cases

CUDA = torch.device("cuda")
IMAGES = 4  # per rank; two views each
READS_VALUES = (DataDependentOutputException, GuardOnDataDependentSymNode)
CLASSES = 3
CASES = objective_cases()


def device_batch(case: ObjectiveCase) -> dict[str, torch.Tensor]:
    """This rank's batch as ``to_device`` leaves it: every tensor on the CUDA device."""
    rows = 2 * IMAGES
    batch = {"images": torch.randn(rows, 3, 16, 16, device=CUDA),
             "ids": torch.arange(IMAGES, device=CUDA).repeat(2),
             "labels": torch.arange(rows, device=CUDA) % CLASSES}
    if case.needs_captions:
        batch["caption_embeddings"] = torch.randn(IMAGES, 12, device=CUDA).repeat(2, 1)
    if case.spec.text_tower:
        batch["input_ids"] = torch.randint(0, 100, (IMAGES, 6), device=CUDA).repeat(2, 1)
        batch["attention_mask"] = torch.ones(rows, 6, dtype=torch.long, device=CUDA)
    return batch


@pytest.mark.parametrize("tile_size,num_negatives", [(None, None), (4, None), (None, 3), (4, 3)])
@pytest.mark.parametrize("case", CASES, ids=case_ids(CASES))
def test_a_training_forward_on_a_cuda_group_keeps_every_tensor_on_the_device(
        case, tile_size, num_negatives, monkeypatch, random_text):
    cfg = ObjectiveConfig.of(case.name, tile_size=tile_size, num_negatives=num_negatives,
                             learnable_temperature=case.spec.text_tower, **case.example)
    # built with real weights (CLIP's text tower loads its checkpoint), then moved;
    # build_model's own CUDA steps but SyncBatchNorm (no fake kernel) run below
    model_cfg = ModelConfig(width=8, projector_hidden=32, projector_dim=16,
                            sync_batchnorm=False, text=random_text)
    model = build_model(model_cfg, cfg, torch.device("cpu"), num_classes=CLASSES).train()
    with cuda_world(world=2, rank=0), fake_cuda() as ran:
        model = model.to(CUDA)
        model.encoder = model.encoder.to(memory_format=torch.channels_last)
        batch = device_batch(case)
        graph = torch.rand(CLASSES, CLASSES, device=CUDA) if case.class_graph else None
        objective = Objective(cfg, graph, CLASSES, rows_per_rank=2 * IMAGES)
        # autocast turns itself off without a driver; it asks only these two
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True)
        with autocast("bf16", CUDA):
            features, _ = model.encoder(batch["images"])
            assert features.dtype == torch.bfloat16  # autocast took effect
            out = forward_loss(model, batch, objective, step=3)
        finite = finite_on_every_rank(out.loss)
        window = MetricWindow()
        window.add(out.metrics)
        assert out.loss.device.type == "cuda" and out.loss.shape == ()
        assert finite.device.type == "cuda"
        on_host = [k for k, v in window.sums.items() if v.device.type != "cuda"]
        assert not on_host, f"metrics not on the device: {on_host}"
    assert "c10d.allgather_.default" in ran.ran  # the global batch went through the group
    assert "c10d.allreduce_.default" in ran.ran  # the finite flag


SCALAR_COLLECTIVES = {
    "totals_over_ranks": lambda: collectives.totals_over_ranks({"a": 1.0, "b": 2.0}, CUDA),
    "sum_over_ranks": lambda: collectives.sum_over_ranks(3.0, CUDA),
    "all_ranks_agree": lambda: collectives.all_ranks_agree(True, CUDA),  # checkpoint load
    "barrier": collectives.barrier,  # checkpoint save
    "row_counts": lambda: collectives.row_counts(torch.empty(3, 2, device=CUDA)),
    "mean_over_ranks_on_device": lambda: collectives.mean_over_ranks_on_device(
        torch.ones((), device=CUDA)),
    "metric_window": lambda: metric_window_means(),
}


def metric_window_means() -> dict[str, float]:
    window = MetricWindow()
    window.add({"loss": torch.ones((), device=CUDA)})
    return window.means_over_ranks()


@pytest.mark.parametrize("name", list(SCALAR_COLLECTIVES))
def test_scalar_collectives_run_on_the_device(name):
    with cuda_world(), fake_cuda() as ran:
        # the fake group returns no values: reading the result back on the host stops
        # there, after the collective was checked
        with contextlib.suppress(*READS_VALUES):
            SCALAR_COLLECTIVES[name]()
    assert ran.ran, f"{name} ran no collective"


def test_the_dry_run_catches_a_reduction_on_the_cpu():
    with cuda_world(), fake_cuda(), pytest.raises(RuntimeError, match="cpu tensor"):
        collectives.totals_over_ranks({"a": 1.0}, torch.device("cpu"))


def test_a_timm_vit_encoder_runs_on_the_device_under_autocast(monkeypatch):
    cfg = ModelConfig(backbone="timm:vit_tiny_patch16_224", image_size=16, patch_size=4,
                      projector_hidden=32, projector_dim=16, sync_batchnorm=False)
    model = build_model(cfg, ObjectiveConfig(), torch.device("cpu")).train()
    with cuda_world(), fake_cuda():
        model = model.to(CUDA)
        model.encoder = model.encoder.to(memory_format=torch.channels_last)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True)
        attention = []
        model.encoder.backbone.blocks[0].attn.qkv.register_forward_hook(
            lambda module, args, out: attention.append(out.dtype))
        with autocast("bf16", CUDA):
            features, projections = model.encoder(torch.randn(8, 3, 16, 16, device=CUDA))
        assert features.device.type == projections.device.type == "cuda"
        assert features.shape == (8, 192)
        assert attention == [torch.bfloat16]  # autocast took effect (its final norm is fp32)
