"""ProjNCE with learned class embeddings (``objective.projnce.projection=learned``) through the real
commands: the run owns and trains the [C, D] matrix, checkpoints it, resumes to exactly the
uninterrupted run, reshards it from 2 DeepSpeed ranks to 1, registers it with the encoder,
and ``evaluate`` reports the classifier by cosine to the learned class embeddings from
the checkpoint and from the registry alike. (The loss itself against the library function
and a float64 loop: ``tests/pretrain/objectives``; 2 ranks against 1 process under DDP and
ZeRO: ``tests/pretrain/distributed/test_engine.py``.)"""

from __future__ import annotations

import json
import re
import shutil

import mlflow
import pytest
import torch
from safetensors.torch import load_file

from data_pipeline.digits import DIGIT_NAMES
from tests.app.helpers import run_pretrain, train_overrides
from tests.data_pipeline.helpers import digit_sample, write_set
from tests.evaluation.test_evaluate import evaluate
from tests.pretrain.distributed.test_engine import ZERO3
from tests.pretrain.run.test_checkpoint import final_model
from tests.pretrain.run.test_reshard import velocities
from tests.scratch import scratch_dir

pytestmark = pytest.mark.long_file  # collected first: tests/conftest.py

KEY = "loss_parameters.class_embeddings"
LEARNED = {"objective.name": "projnce", "objective.projnce.projection": "learned",
           "checkpoint.every": 4, "checkpoint.keep": 10, "data.workers": 1}


@pytest.fixture(scope="module")
def learned_run(digits_shards, tmp_path_factory):
    with scratch_dir(tmp_path_factory, "projnce-learned") as root:
        write_set(root / "test", [[digit_sample(i) for i in range(360, 460)]], DIGIT_NAMES)
        overrides = train_overrides(digits_shards, root, **LEARNED, **{
            "train.max_steps": 12, "tracking.enabled": True, "tracking.system_metrics": False,
            "tracking.registered_model": "digits-projnce", "eval.train_shards": digits_shards,
            "eval.test_shards": root / "test", "eval.probe_epochs": 5, "eval.save_index": False})
        result = run_pretrain(overrides)
        assert result.returncode == 0, result.stderr[-3000:]
        yield root, overrides


def checkpoint_model(root, step: int) -> dict[str, torch.Tensor]:
    path = root / "run" / "checkpoints" / f"step_{step:08d}" / "shared.pt"
    return torch.load(path, weights_only=True)["model"]


def test_the_class_embeddings_are_trained_and_checkpointed(learned_run):
    root, _ = learned_run
    early, late = checkpoint_model(root, 4), checkpoint_model(root, 12)
    assert early[KEY].shape == (10, 32)  # the digits' 10 classes x model.projector_dim
    assert not torch.equal(early[KEY], late[KEY])


def test_a_resumed_run_equals_the_uninterrupted_one(learned_run, tmp_path):
    root, overrides = learned_run
    shutil.copytree(root / "run" / "checkpoints" / "step_00000008",
                    tmp_path / "run" / "checkpoints" / "step_00000008")
    moved = [f"output_dir={tmp_path}" if o.startswith("output_dir=") else o
             for o in overrides]
    result = run_pretrain([*moved, "tracking.enabled=false"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "at step 8" in result.stderr
    resumed, whole = final_model(tmp_path / "run"), final_model(root / "run")
    assert resumed["step"] == whole["step"] == 12
    assert set(resumed["model"]) == set(whole["model"]) and KEY in whole["model"]
    for key, value in whole["model"].items():
        assert torch.equal(resumed["model"][key], value), key


def test_the_registry_and_the_checkpoint_evaluate_the_class_embedding_classifier(
        learned_run):
    root, overrides = learned_run
    found = {}
    for name, source in (("checkpoint", ""), ("registry", "models:/digits-projnce/1")):
        result = evaluate(overrides, f"eval.model={source}", f"eval.output={root / name}")
        assert result.returncode == 0, result.stderr[-3000:]
        found[name] = json.loads((root / name / "results.json").read_text())
        assert "learned class embeddings" in (root / name / "report.md").read_text()
    classifier = found["checkpoint"]["class_embedding_classifier"]
    assert classifier["classes"] == 10
    assert 0 <= classifier["accuracy"]["top1"] <= classifier["accuracy"]["top5"] <= 1
    assert found["registry"]["class_embedding_classifier"] == classifier
    store = f"sqlite:///{root / 'run' / 'mlflow.db'}"
    mlflow.set_tracking_uri(store)
    mlflow.set_registry_uri(store)  # not one an earlier test in this process set
    stored = mlflow.artifacts.download_artifacts("models:/digits-projnce/1",
                                                 dst_path=str(root / "download"))
    table = load_file(f"{stored}/artifacts/class_embeddings.safetensors")["class_embeddings"]
    assert torch.equal(table, checkpoint_model(root, 12)[KEY].float())


def test_two_deepspeed_ranks_reshard_the_class_embeddings_onto_one(digits_shards, tmp_path):
    """ZeRO-2 partitions the class embeddings with every other parameter. Resumed on 1 rank
    at lr 1e-30, 4 LARS steps only play out the checkpoint's momentum (v <- 0.9 v,
    w <- w - v; as ``tests/pretrain/run/test_reshard.py`` checks the encoder): the final matrix
    equals that replay of the 2-rank checkpoint's matrix and velocity."""
    zero2 = {"engine.name": "deepspeed",
             "engine.deepspeed_config": "launch/deepspeed/zero2.json", "train.max_steps": 8}
    two = train_overrides(digits_shards, tmp_path / "two", **LEARNED, **zero2,
                          **{"data.batch_size": 8})
    result = run_pretrain(two, nproc=2, torchrun=True)
    assert result.returncode == 0, result.stderr[-3000:]
    source = tmp_path / "two" / "run" / "checkpoints" / "step_00000004"
    shutil.copytree(source, tmp_path / "one" / "run" / "checkpoints" / source.name)
    one = train_overrides(digits_shards, tmp_path / "one", **LEARNED, **zero2,
                          **{"optim.lr": 1e-30})
    result = run_pretrain(one, nproc=1, torchrun=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "written by 2 ranks, resumed on 1" in result.stderr
    weight = torch.load(source / "shared.pt", weights_only=True)["model"][KEY].clone()
    velocity = velocities(source)[KEY].clone()
    assert velocity.abs().max() > 0  # the optimiser trains the matrix
    for _ in range(4):
        velocity.mul_(0.9)
        weight.sub_(velocity)
    end = final_model(tmp_path / "one" / "run")
    assert end["step"] == 8 and end["world"] == 1
    torch.testing.assert_close(end["model"][KEY], weight, rtol=0, atol=1e-9)


def test_two_fsdp2_ranks_register_the_whole_encoder(digits_shards, tmp_path):
    """FSDP2 shards the encoder and the class embeddings over 2 ranks and writes sharded
    checkpoints (each rank its shards); the registry still receives them whole (rank 0
    reads them from the final checkpoint), equal to that checkpoint; the kNN monitor runs
    the sharded encoder mid-run; ``evaluate`` reads the sharded checkpoint whole and reports
    what it reports from the registry."""
    fsdp2 = {"engine.name": "fsdp2", "checkpoint.format": "sharded", "train.max_steps": 8,
             "data.batch_size": 8,
             "tracking.enabled": True, "tracking.system_metrics": False,
             "tracking.registered_model": "digits-fsdp2", "train.knn_every": 4,
             "train.knn_samples": 64, "eval.train_shards": str(digits_shards),
             "eval.test_shards": str(digits_shards), "eval.probe_epochs": 5,
             "eval.save_index": False}
    overrides = train_overrides(digits_shards, tmp_path, **LEARNED, **fsdp2)
    result = run_pretrain(overrides, nproc=2, torchrun=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(re.findall(r"step [48] knn monitor: top-1 0\.\d+", result.stderr)) == 2
    final = final_model(tmp_path / "run")
    assert final["step"] == 8 and final["world"] == 2 and final["state"] == "dcp"
    found = {}
    for name, source in (("checkpoint", ""), ("registry", "models:/digits-fsdp2/1")):
        result = evaluate(overrides, f"eval.model={source}", f"eval.output={tmp_path / name}")
        assert result.returncode == 0, result.stderr[-3000:]
        found[name] = json.loads((tmp_path / name / "results.json").read_text())
    assert found["checkpoint"]["class_embedding_classifier"]["classes"] == 10
    for key in ("class_embedding_classifier", "knn", "linear_probe"):
        assert found["checkpoint"][key] == found["registry"][key], key
    assert_registered_whole(tmp_path, "digits-fsdp2", final["model"])


def test_two_zero3_ranks_register_the_whole_encoder(digits_shards, tmp_path):
    """DeepSpeed ZeRO-3 partitions every parameter, the class embeddings included, over 2
    ranks (each module's parameters gathered only while it runs); the kNN monitor runs the
    partitioned encoder mid-run; the checkpoint holds the model whole (gathered module by
    module to rank 0) and the registry receives it whole, equal to the final checkpoint."""
    zero3 = {"engine.name": "deepspeed", "engine.deepspeed_config": ZERO3,
             "train.max_steps": 8, "data.batch_size": 8, "tracking.enabled": True,
             "tracking.system_metrics": False, "tracking.registered_model": "digits-zero3",
             "train.knn_every": 4, "train.knn_samples": 64,
             "eval.train_shards": str(digits_shards), "eval.test_shards": str(digits_shards)}
    overrides = train_overrides(digits_shards, tmp_path, **LEARNED, **zero3)
    result = run_pretrain(overrides, nproc=2, torchrun=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(re.findall(r"step [48] knn monitor: top-1 0\.\d+", result.stderr)) == 2
    final = final_model(tmp_path / "run")
    assert final["step"] == 8 and final["world"] == 2
    assert final["model"][KEY].shape == (10, 32)  # whole, not a rank's partition
    assert_registered_whole(tmp_path, "digits-zero3", final["model"])


def assert_registered_whole(root, name: str, model: dict[str, torch.Tensor]) -> None:
    """Version 1 of registered model ``name`` in ``root``'s run holds the encoder and the
    class embeddings of the checkpoint state ``model``, whole."""
    store = f"sqlite:///{root / 'run' / 'mlflow.db'}"
    mlflow.set_tracking_uri(store)
    mlflow.set_registry_uri(store)  # not one an earlier test in this process set
    stored = mlflow.artifacts.download_artifacts(f"models:/{name}/1",
                                                 dst_path=str(root / "download"))
    table = load_file(f"{stored}/artifacts/class_embeddings.safetensors")["class_embeddings"]
    assert torch.equal(table, model[KEY].float())
    encoder = load_file(f"{stored}/artifacts/encoder.safetensors")
    assert len(encoder) > 10
    for key, value in encoder.items():
        assert torch.equal(value, model[f"encoder.{key}"].float()), key
