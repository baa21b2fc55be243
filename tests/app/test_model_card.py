"""The exported card carries the registered version's evaluation, through the commands: a
ResNet-18 trained and registered, exported before and after ``evaluate``; the figures in
the card's table, in its ``model-index`` block (read back by huggingface_hub) and in the
ONNX metadata are the ones ``results.json`` holds. A version never evaluated, and a
checkpoint, say so in one line; a tampered tag is refused naming it."""

from __future__ import annotations

import json

import mlflow
import pytest

from registry.evaluation_record import EVALUATION_TAG
from tests.app.helpers import run_pretrain, train_overrides
from tests.evaluation.test_evaluate import evaluate
from tests.scratch import scratch_dir

NAME = "card-resnet"


@pytest.fixture(scope="module")
def registered(digits_shards, tmp_path_factory):
    with scratch_dir(tmp_path_factory, "card") as root:
        overrides = train_overrides(digits_shards, root, **{
            "model.backbone": "resnet18", "model.small_stem": False,
            "tracking.enabled": True, "tracking.system_metrics": False, "train.max_steps": 2,
            "tracking.registered_model": NAME, "eval.train_shards": digits_shards,
            "eval.test_shards": digits_shards, "eval.probe_epochs": 3,
            "eval.compare_untrained": True})
        result = run_pretrain(overrides)
        assert result.returncode == 0, result.stderr[-3000:]
        yield root, overrides


def export(root, overrides, source: str, fmt: str, out) -> None:
    from app.export import main

    main([*overrides, f"export.model={source}", f"export.format={fmt}",
          f"export.output={out}"])


def onnx_evaluation(folder):
    import onnx

    meta = {p.key: p.value for p in onnx.load(str(folder / "model.onnx"),
                                              load_external_data=False).metadata_props}
    return json.loads(meta["evaluation"])


def card_metrics(card: str) -> dict[str, float]:
    from huggingface_hub import ModelCard

    results = ModelCard(card).data.eval_results
    return {r.metric_name: r.metric_value for r in results}


def test_the_card_carries_the_evaluation_once_the_version_has_one(registered, tmp_path):
    root, overrides = registered
    export(root, overrides, f"models:/{NAME}/1", "timm", tmp_path / "before")
    card = (tmp_path / "before" / "README.md").read_text()
    assert "Not evaluated: this registered version has no evaluation on record" in card
    assert "model-index" not in card
    export(root, overrides, f"models:/{NAME}/1", "onnx", tmp_path / "onnx-before")
    assert onnx_evaluation(tmp_path / "onnx-before").startswith("Not evaluated")

    result = evaluate(overrides, f"eval.model=models:/{NAME}/1",
                      f"eval.output={root / 'eval'}")
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads((root / "eval" / "results.json").read_text())
    trained = {"knn": results["knn"]["backbone"]["k20"]["top1"],
               "probe": results["linear_probe"]["top1"],
               "untrained_knn": results["untrained"]["knn"]["backbone"]["k20"]["top1"],
               "untrained_probe": results["untrained"]["linear_probe"]["top1"]}

    export(root, overrides, f"models:/{NAME}/1", "timm", tmp_path / "after")
    card = (tmp_path / "after" / "README.md").read_text()
    assert (f"| backbone kNN top-1 (k=20) | {100 * trained['knn']:.1f}% | "
            f"{100 * trained['untrained_knn']:.1f}% |") in card
    assert (f"| linear probe top-1 | {100 * trained['probe']:.1f}% | "
            f"{100 * trained['untrained_probe']:.1f}% |") in card
    assert "360 test images" in card and f"run `{results['mlflow_run_id']}`" in card
    metrics = card_metrics(card)
    assert metrics == pytest.approx({
        "kNN top-1 (backbone, k=20)": trained["knn"], "linear probe top-1": trained["probe"],
        "untrained kNN top-1 (backbone, k=20)": trained["untrained_knn"],
        "untrained linear probe top-1": trained["untrained_probe"]}, abs=1e-6)

    export(root, overrides, f"models:/{NAME}/1", "onnx", tmp_path / "onnx-after")
    meta = onnx_evaluation(tmp_path / "onnx-after")
    assert (meta["knn_top1"], meta["probe_top1"]) == (trained["knn"], trained["probe"])
    assert meta["test_samples"] == 360 and meta["run_id"] == results["mlflow_run_id"]


def test_a_checkpoint_export_says_it_is_not_a_registered_version(registered, tmp_path):
    root, overrides = registered
    checkpoint = sorted((root / "run" / "checkpoints").glob("step_*"))[-1]
    export(root, overrides, str(checkpoint), "timm", tmp_path / "out")
    card = (tmp_path / "out" / "README.md").read_text()
    assert "Not evaluated: exported from a checkpoint or run, not a registered version" in card


@pytest.mark.parametrize(("tag", "said"), [
    ("{not json", "the evaluation tag is not JSON"),
    ('{"knn_top1": 7}', "the evaluation tag has no date"),
    ('{"script": "x"}', "the evaluation tag has unknown field 'script'"),
])
def test_a_tampered_evaluation_tag_is_refused_naming_it(registered, tmp_path, capsys, tag,
                                                        said):
    root, overrides = registered
    uri = f"sqlite:///{root / 'run' / 'mlflow.db'}"
    client = mlflow.MlflowClient(uri, registry_uri=uri)
    saved = client.get_model_version(NAME, "1").tags.get(EVALUATION_TAG)
    client.set_model_version_tag(NAME, "1", EVALUATION_TAG, tag)
    try:
        with pytest.raises(SystemExit):
            export(root, overrides, f"models:/{NAME}/1", "timm", tmp_path / "out")
    finally:
        if saved is None:
            client.delete_model_version_tag(NAME, "1", EVALUATION_TAG)
        else:
            client.set_model_version_tag(NAME, "1", EVALUATION_TAG, saved)
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"export: error: models:/{NAME}/1: {said}"), last
    assert not (tmp_path / "out").exists()
