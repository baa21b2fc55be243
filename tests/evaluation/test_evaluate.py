"""``evaluate`` end to end on the digits: a trained, registered encoder evaluated from its
registry URI (with promotion), and from its checkpoint with 2 ranks."""

from __future__ import annotations

import json
import os
import subprocess

import mlflow
import numpy as np
import pytest

from data_pipeline.digits import DIGIT_NAMES
from data_pipeline.formats import Sample
from data_pipeline.graph.config import GraphConfig
from data_pipeline.graph.job import run_captions
from tests import prewarmed
from tests.app.helpers import run_pretrain, train_overrides
from tests.data_pipeline.helpers import digit_jpeg, digit_sample, write_set
from tests.scratch import scratch_dir


@pytest.fixture(scope="module")
def trained(digits_shards, tmp_path_factory):
    with scratch_dir(tmp_path_factory, "evaluate") as root:
        test_shards = root / "test-shards"
        write_set(test_shards, [[digit_sample(i) for i in range(360, 460)]], DIGIT_NAMES)
        graph = root / "class_graph.npz"
        rng = np.random.default_rng(0)
        vectors = rng.normal(size=(10, 8))
        vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
        np.savez(graph, graph=vectors @ vectors.T, class_names=np.array(DIGIT_NAMES))
        overrides = train_overrides(digits_shards, root, **{
            "tracking.enabled": True, "tracking.system_metrics": False, "train.max_steps": 4,
            "tracking.registered_model": "digits-eval-test", "eval.class_graph": graph,
            "eval.train_shards": digits_shards, "eval.test_shards": test_shards,
            "eval.probe_epochs": 5, "eval.class_groups": "[[0,1,2,3],[4,5,6,7,8,9]]"})
        # a caption store of the training shards: evaluation must not join it to its shards
        run_captions(GraphConfig(shards=str(digits_shards), output=str(root / "captions")))
        monitor = ["train.knn_every=2", "train.knn_samples=64"]
        result = run_pretrain([*overrides, *monitor])
        assert result.returncode == 0, result.stderr[-3000:]
        assert result.stderr.count("knn monitor: top-1") == 2  # steps 2 and 4
        yield root, overrides


def evaluate(overrides: list[str], *extra: str, nproc: int = 1) -> subprocess.CompletedProcess:
    """``evaluate`` in one process or under torchrun, forked from a pre-imported interpreter
    (``tests/prewarmed.py``)."""
    if nproc == 1:
        return prewarmed.run_module("app.evaluate", [*overrides, *extra], dict(os.environ),
                                    timeout=600)
    return prewarmed.run_torchrun("app.evaluate", [*overrides, *extra], nproc,
                                  dict(os.environ), timeout=600)


def test_registry_uri_end_to_end_with_promotion(trained):
    root, overrides = trained
    result = evaluate(overrides, "eval.model=models:/digits-eval-test/1",
                      "eval.output=" + str(root / "eval-registry"), "--promote", "champion",
                      f"data.caption_store={root / 'captions'}")
    assert result.returncode == 0, result.stderr[-3000:]
    out = root / "eval-registry"
    results = json.loads((out / "results.json").read_text())
    assert results["samples"] == {"train": 360, "test": 100}
    for space in ("backbone", "projector"):
        assert list(results["knn"][space]) == [f"k{k}" for k in (1, 5, 10, 20, 50, 100, 200)]
        for value in results["knn"][space].values():
            assert 0 <= value["top1"] <= value["top5"] <= 1
        diag = results["diagnostics"][space]
        assert diag["etf_cosine"] == pytest.approx(-1 / 9)
        assert -1 <= diag["rank_correlation"] <= 1
    assert results["linear_probe"]["top1"] > 0.1
    for plot in results["plots"]:
        assert (out / plot).stat().st_size > 1000
    assert "| backbone top-1 |" in (out / "report.md").read_text()
    assert results["promotion"]["promoted"] is True

    uri = f"sqlite:///{root / 'run' / 'mlflow.db'}"
    client = mlflow.MlflowClient(uri, registry_uri=uri)
    training_run = (root / "run" / "mlflow_run_id").read_text()
    eval_run = client.get_run(results["mlflow_run_id"])
    assert eval_run.data.tags["mlflow.parentRunId"] == training_run
    top1 = results["knn"]["backbone"]["k20"]["top1"]
    assert eval_run.data.metrics["knn.backbone.k20.top1"] == pytest.approx(top1)
    monitored = client.get_metric_history(training_run, "knn_top1")
    assert [m.step for m in monitored] == [2, 4]
    logged = {a.path for a in client.list_artifacts(eval_run.info.run_id)}
    assert logged >= {"results.json", "report.md", "knn_accuracy.png"}
    assert "indexes" not in results  # exact search reads the bank itself: nothing saved
    assert not (out / "features").exists()  # the bank's files, removed once read
    assert str(client.get_model_version_by_alias("digits-eval-test", "champion").version) == "1"


def test_checkpoint_with_two_ranks_equals_one(trained):
    root, overrides = trained
    plain = [*overrides, "tracking.enabled=false", "eval.save_index=false"]
    # 1 process with an IVF index probing every list (so: exact), 2 with faiss's flat index
    one = evaluate(plain, "eval.output=" + str(root / "eval-1"), "eval.index=ivf",
                   "eval.ivf_lists=8", "eval.ivf_probe=8")
    two = evaluate(plain, "eval.output=" + str(root / "eval-2"), nproc=2)
    assert one.returncode == 0, one.stderr[-3000:]
    assert two.returncode == 0, two.stderr[-3000:]
    a = json.loads((root / "eval-1" / "results.json").read_text())
    b = json.loads((root / "eval-2" / "results.json").read_text())
    assert a["model"]["source"].endswith("step_00000004")
    assert a["ivf"]["top1"] == pytest.approx(a["ivf"]["exact_top1"])
    for space in ("backbone", "projector"):
        for k, value in a["knn"][space].items():
            assert b["knn"][space][k]["top1"] == pytest.approx(value["top1"])


def test_checkpoint_run_and_registry_sources_load_the_same_encoder(trained):
    import torch

    from evaluation.load import load_model

    root, _ = trained
    run_dir = root / "run"
    uri = f"sqlite:///{run_dir / 'mlflow.db'}"
    run_id = (run_dir / "mlflow_run_id").read_text()
    image = torch.rand(2, 3, 16, 16)
    outputs = []
    for source in ("", f"runs:/{run_id}/encoder", "models:/digits-eval-test/latest"):
        model, ref = load_model(source, run_dir, uri)
        assert ref.run_id == run_id
        with torch.no_grad():
            outputs.append((model.eval()(image), model.features(image)))
    for projections, features in outputs[1:]:
        torch.testing.assert_close(projections, outputs[0][0])
        torch.testing.assert_close(features, outputs[0][1])


def perturbed_checkpoint(root, name: str, seed: int):
    """A copy of the run's newest checkpoint with other weights: a different model."""
    import torch

    source = sorted((root / "run" / "checkpoints").glob("step_*"))[-1] / "shared.pt"
    state = torch.load(source, weights_only=True)
    generator = torch.Generator().manual_seed(seed)
    state["model"] = {k: v + 0.5 * torch.randn(v.shape, generator=generator)  # variances
                      if v.is_floating_point() and not k.endswith("running_var") else v
                      for k, v in state["model"].items()}  # stay positive: finite features
    (root / name).mkdir()
    torch.save(state, root / name / "shared.pt")
    return root / name


def test_a_saved_index_serves_only_the_model_and_bank_it_was_built_from(trained):
    root, overrides = trained
    plain = [*overrides, "tracking.enabled=false", "eval.probe_epochs=1", "eval.index=ivf",
             "eval.ivf_lists=8", "eval.ivf_probe=2"]
    other = perturbed_checkpoint(root, "other-model", seed=1)
    shared = root / "eval-shared"
    runs = {}
    for label, model, out in (("a", "", shared), ("b", other, shared),
                              ("b-alone", other, root / "eval-alone"), ("a-again", "", shared)):
        result = evaluate(plain, f"eval.model={model}", f"eval.output={out}")
        assert result.returncode == 0, result.stderr[-3000:]
        runs[label] = json.loads((out / "results.json").read_text())
    assert runs["a"]["identity"]["model_sha256"] != runs["b"]["identity"]["model_sha256"]
    assert runs["a"]["identity"]["bank_sha256"] == runs["b"]["identity"]["bank_sha256"]
    for space in ("backbone", "projector"):
        assert runs["b"]["knn"][space] == runs["b-alone"]["knn"][space]
        assert runs["a-again"]["knn"][space] == runs["a"]["knn"][space]
        assert runs["a"]["knn"][space] != runs["b"]["knn"][space]
        assert len(list(shared.glob(f"indexes/index_{space}_ivf_*.faiss"))) == 2
        assert runs["a-again"]["indexes"][space].startswith(str(shared / "indexes"))


def test_unlabelled_shards_fail_before_any_feature_extraction(trained, tmp_path):
    root, overrides = trained
    unlabelled = tmp_path / "unlabelled"
    write_set(unlabelled, [[Sample(f"u{i}", digit_jpeg(i), "jpg", None, "a digit")
                            for i in range(20)]])
    manifest = json.loads((unlabelled / "manifest.json").read_text())
    manifest["class_names"] = []
    (unlabelled / "manifest.json").write_text(json.dumps(manifest))
    result = evaluate([*overrides, "tracking.enabled=false"], f"eval.test_shards={unlabelled}",
                      f"eval.output={tmp_path / 'eval'}")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        f"evaluate: error: eval.test_shards={unlabelled}: its manifest lists no classes; kNN "
        "and the linear probe need labelled shards (make-shards with labels)")
    assert "features" not in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "eval").exists()
