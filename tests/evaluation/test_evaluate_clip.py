"""``evaluate`` on image-text runs (CLIP, SigLIP): image-text retrieval on held-out caption
shards and zero-shot classification from class-name prompts, beside kNN and the probe,
from the checkpoint and from the registry (whose version carries the text tower)."""

from __future__ import annotations

import json

import mlflow
import pytest

from data_pipeline.digits import DIGIT_NAMES
from tests.app.helpers import run_pretrain, train_overrides
from tests.data_pipeline.helpers import digit_sample, write_set
from tests.evaluation.test_evaluate import evaluate
from tests.scratch import scratch_dir

pytestmark = pytest.mark.long_file  # collected first: tests/conftest.py


@pytest.fixture(scope="module", params=["clip", "siglip"])
def clip_run(digits_shards, tmp_path_factory, request):
    objective = request.param
    with scratch_dir(tmp_path_factory, f"evaluate-{objective}") as root:
        write_set(root / "test", [[digit_sample(i) for i in range(360, 460)]], DIGIT_NAMES)
        write_set(root / "captions", [[digit_sample(i) for i in range(460, 540)]], DIGIT_NAMES)
        write_set(root / "no-captions", [[digit_sample(i, caption=None) for i in range(20)]],
                  DIGIT_NAMES)
        overrides = train_overrides(digits_shards, root, **{
            "objective.name": objective, "train.max_steps": 2, "tracking.enabled": True,
            # heads open_clip expresses (projector_hidden = 2 x projector_dim already)
            "model.backbone": "resnet18", "model.small_stem": False,
            "model.projector_activation": "gelu", "model.text.projection_bias": False,
            "tracking.system_metrics": False, "tracking.registered_model": f"digits-{objective}",
            "objective.learnable_temperature": True,
            "eval.train_shards": digits_shards, "eval.test_shards": root / "test",
            "eval.probe_epochs": 5, "eval.save_index": False,
            "eval.zero_shot_templates": "['a photo of the digit {}.','the number {}']"})
        result = run_pretrain(overrides, timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
        yield root, overrides, objective


def test_clip_run_reports_retrieval_and_zero_shot(clip_run):
    root, overrides, objective = clip_run
    model = f"digits-{objective}"
    runs = {}
    for name, source in (("checkpoint", ""), ("registry", f"models:/{model}/1")):
        result = evaluate(overrides, f"eval.model={source}", f"eval.output={root / name}",
                          f"eval.retrieval_shards={root / 'captions'}")
        assert result.returncode == 0, result.stderr[-3000:]
        runs[name] = json.loads((root / name / "results.json").read_text())
    results = runs["checkpoint"]
    found = results["retrieval"]
    # the digits' captions name the class: 10 distinct captions for 80 images
    assert (found["images"], found["captions"]) == (80, 10)
    for direction in ("image_to_text", "text_to_image"):
        recall = found[direction]
        assert list(recall) == ["R@1", "R@5", "R@10"]
        assert 0 <= recall["R@1"] <= recall["R@5"] <= recall["R@10"] <= 1
    assert found["image_to_text"]["R@10"] == 1.0  # 10 captions: all of them are in the top 10
    zero_shot = results["zero_shot"]
    assert zero_shot["classes"] == 10 and len(zero_shot["templates"]) == 2
    assert 0 <= zero_shot["accuracy"]["top1"] <= zero_shot["accuracy"]["top5"] <= 1
    assert "knn" in results and "linear_probe" in results
    # the registered version holds the text tower: the same numbers from the registry
    assert runs["registry"]["retrieval"] == found  # counts of hits: exactly equal
    assert runs["registry"]["zero_shot"] == zero_shot
    report = (root / "checkpoint" / "report.md").read_text()
    assert "| image to text |" in report and "Zero-shot classification (10 classes" in report

    uri = f"sqlite:///{root / 'run' / 'mlflow.db'}"
    client = mlflow.MlflowClient(uri, registry_uri=uri)
    metrics = client.get_run(results["mlflow_run_id"]).data.metrics
    assert metrics["retrieval.image_to_text.R_1"] == pytest.approx(
        found["image_to_text"]["R@1"])
    assert metrics["zero_shot.accuracy.top1"] == pytest.approx(zero_shot["accuracy"]["top1"])
    version = client.get_model_version(model, "1")
    assert "artifacts/text_tower.safetensors" in json.loads(version.tags["artifact_sha256"])
    trained = client.get_run(version.run_id).data.metrics
    assert "temperature" in trained
    assert ("bias" in trained) == (objective == "siglip")  # the learned loss parameter


def test_retrieval_shards_without_captions_fail_in_one_line(clip_run, digits_shards):
    """... before the work: the training bank's features are never extracted."""
    root, overrides, _ = clip_run
    result = evaluate([*overrides, "tracking.enabled=false"],
                      f"eval.output={root / 'none'}",
                      f"eval.retrieval_shards={root / 'no-captions'}")
    assert result.returncode == 1
    assert f"eval.retrieval_shards={root / 'no-captions'}: no sample has a caption" in (
        result.stderr.strip().splitlines()[-1])
    assert f"features {root / 'no-captions'}" in result.stderr  # its progress bar
    assert f"features {digits_shards}" not in result.stderr
    assert not (root / "none" / "results.json").exists()


def test_the_registered_version_exports_as_an_open_clip_folder(clip_run, tmp_path):
    """``export`` from the registry (digests checked) to an open_clip folder: open_clip
    gives the embeddings of the encoder ``evaluate`` loads (images at the run's 16 px)."""
    import torch

    from app.export import main
    from evaluation.load import load_encoder
    from tests.serving.test_open_clip_folder import assert_same_embeddings, open_clip_embeddings

    root, overrides, objective = clip_run
    source = f"models:/digits-{objective}/1"
    main([*overrides, f"export.model={source}", "export.format=open_clip",
          f"export.output={tmp_path / 'folder'}"])
    uri = f"sqlite:///{root / 'run' / 'mlflow.db'}"
    model = load_encoder(source, root / "run", uri).model.eval()
    images = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    loaded = open_clip_embeddings(tmp_path / "folder", images, tmp_path)
    assert_same_embeddings(loaded, model, images, max_length=32)
