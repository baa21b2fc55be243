"""Feature extraction on a CUDA device in a 2-rank CUDA-only process group, dry run on the
CPU (``tests/cuda_dry_run.py``): no CPU tensor may reach a collective (NCCL has no CPU
backend). On the code that gathered CPU features to every rank this failed with
``c10d.allgather_.default: a cpu tensor (1,) handed to a collective of a CUDA process
group`` (the row-count exchange), as ``evaluate`` and the kNN monitor did on 2 GPUs."""

from __future__ import annotations

import torch

import core.collectives
from data_pipeline.config import DataConfig
from data_pipeline.loader import eval_batches
from evaluation import features
from pretrain.model.encoder import Encoder, ModelConfig
from registry.package import EmbeddingModel
from tests.cuda_dry_run import cuda_world, fake_cuda
from tests.data_pipeline.helpers import digit_sample, write_set


def test_extract_on_cuda_hands_collectives_cuda_tensors_only(tmp_path, monkeypatch):
    write_set(tmp_path / "shards", [[digit_sample(i) for i in range(10)],
                                    [digit_sample(i) for i in range(10, 17)]])
    data = DataConfig(batch_size=4, workers=0, resolution=16)
    # what needs values comes from outside the fake world: the images (decoded on the
    # CPU before any fake tensor exists), the row counts and keys the fake group cannot
    # carry (rank 1 is taken to hold as many rows as rank 0)
    batches = list(eval_batches(DataConfig(shards=str(tmp_path / "shards"), batch_size=4,
                                           workers=0, resolution=16), 0, 2))
    monkeypatch.setattr(features, "eval_batches", lambda *args, **kwargs: iter(batches))
    monkeypatch.setattr(core.collectives, "row_counts",
                        lambda local, group=None, device=None: [local.shape[0]] * 2)
    monkeypatch.setattr(features, "gather_objects_to_main", lambda items: items * 2)
    model = EmbeddingModel(Encoder(ModelConfig(projector_hidden=32, projector_dim=8)))
    rows = sum(len(b["keys"]) for b in batches)
    with cuda_world(world=2, rank=0), fake_cuda():
        got = features.extract(model, data, str(tmp_path / "shards"), torch.device("cuda"),
                               0, 2, progress=False, transfer_mib=0)  # a chunk per row
        assert got.backbone.shape == (2 * rows, model.encoder.feature_dim)
        assert got.projector.shape == (2 * rows, 8)
        assert {got.backbone.device.type, got.labels.device.type} == {"cpu"}


def test_the_knn_monitor_on_cuda_extracts_through_the_device(tmp_path, monkeypatch):
    import contextlib

    from torch._subclasses.fake_tensor import DataDependentOutputException
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    from evaluation.config import EvalConfig
    from evaluation.monitor import KnnMonitor

    write_set(tmp_path / "shards", [[digit_sample(i) for i in range(12)]])
    shards = str(tmp_path / "shards")
    batches = list(eval_batches(DataConfig(shards=shards, batch_size=4, workers=0,
                                           resolution=16), 0, 2))
    monkeypatch.setattr(features, "eval_batches", lambda *args, **kwargs: iter(batches))
    monkeypatch.setattr(core.collectives, "row_counts",
                        lambda local, group=None, device=None: [local.shape[0]] * 2)
    monkeypatch.setattr(features, "gather_objects_to_main", lambda items: items * 2)
    encoder = Encoder(ModelConfig(projector_hidden=32, projector_dim=8))
    monitor = KnnMonitor(DataConfig(batch_size=4, workers=0, resolution=16),
                         EvalConfig(train_shards=shards, test_shards=shards), samples=8,
                         device=torch.device("cuda"), rank=0, world=2)
    with cuda_world(world=2, rank=0), fake_cuda() as ran:
        # the fake group returns no labels to count classes with: the monitor stops at
        # that read, after both extractions went through the group
        with contextlib.suppress(DataDependentOutputException, GuardOnDataDependentSymNode):
            monitor(encoder)
    assert ran.ran.count("c10d.gather_.default") >= 2 * 3  # bank and queries, 3 tensors each


def test_the_dry_run_refuses_a_cpu_tensor_in_a_collective():
    import pytest
    import torch.distributed as dist

    with cuda_world(), fake_cuda():
        dist.all_gather([torch.empty(2, device="cuda")] * 2, torch.ones(2, device="cuda"))
        with pytest.raises(RuntimeError, match="cpu tensor .* handed to a collective"):
            dist.all_gather([torch.empty(2)] * 2, torch.ones(2))
        with pytest.raises(Exception, match="same device|devices"):
            torch.ones(2, device="cuda") + torch.ones(2)
