"""Exported encoders loaded back by the real libraries: onnxruntime runs ``model.onnx``
with any batch size and gives our features within 1e-4 (float32 kernels of two runtimes);
``timm.create_model("local-dir:...")`` builds our backbone and gives its features within
1e-5 on the same images, and timm's data config is the run's evaluation view. Backbones a
format cannot take are refused in one line naming the formats they can."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from core.errors import RunError
from data_pipeline.transforms import MEAN, STD
from pretrain.model.encoder import Encoder, ModelConfig
from registry.package import EmbeddingModel
from serving.export import ExportConfig, Exported, export

pytestmark = pytest.mark.long_file  # collected first: tests/conftest.py

R = 32
TREE = {"data": {"resolution": R, "batch_size": 64, "augment": "simclr"},
        "objective": {"name": "supcon", "temperature": 0.1}, "train": {"epochs": 10}}


def exported(cfg: ModelConfig, seed: int = 0) -> Exported:
    torch.manual_seed(seed)
    model = EmbeddingModel(Encoder(cfg))
    with torch.no_grad():  # batch-norm statistics that are not the initial ones
        model.train()(torch.randn(16, 3, R, R) * 2 + 0.5)
    return Exported(model.eval(), cfg, TREE, "runs/test/checkpoints/step_00000010")


SMALL_CNN = ModelConfig(width=8, projector_hidden=16, projector_dim=8, image_size=R)
VIT = ModelConfig(backbone="timm:test_vit", patch_size=8, projector_hidden=16,
                  projector_dim=8, image_size=R)
RESNET = ModelConfig(backbone="resnet18", small_stem=False, projector_hidden=16,
                     projector_dim=8, image_size=R)
RESNET50 = ModelConfig(backbone="resnet50", small_stem=False, projector_hidden=16,
                       projector_dim=8, image_size=R)


@pytest.mark.parametrize(("cfg", "space"), [(SMALL_CNN, "backbone"), (SMALL_CNN, "projector"),
                                            (VIT, "backbone"), (RESNET, "backbone"),
                                            (RESNET50, "backbone")],
                         ids=["small_cnn", "small_cnn-projector", "vit", "resnet18", "resnet50"])
def test_onnxruntime_gives_our_features_at_any_batch_size(tmp_path, cfg, space):
    import onnx
    import onnxruntime

    item = exported(cfg)
    out = export(item, ExportConfig(format="onnx", output=str(tmp_path / "onnx"), space=space))
    session = onnxruntime.InferenceSession(str(out / "model.onnx"),
                                           providers=["CPUExecutionProvider"])
    for batch in (1, 5):
        images = torch.randn(batch, 3, R, R, generator=torch.Generator().manual_seed(batch))
        (got,) = session.run(None, {"images": images.numpy()})
        with torch.no_grad():
            features, projections = item.model.encoder(images)
        want = (features if space == "backbone" else projections).numpy()
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)
    meta = {p.key: json.loads(p.value) for p in onnx.load(str(out / "model.onnx")).metadata_props}
    assert meta["input_size"] == [3, R, R] and meta["space"] == space
    assert meta["mean"] == list(MEAN) and meta["std"] == list(STD) and meta["crop_pct"] == 0.875


@pytest.mark.parametrize("cfg", [VIT, RESNET, RESNET50], ids=["vit", "resnet18", "resnet50"])
def test_timm_loads_the_folder_as_our_backbone_with_the_run_s_view(tmp_path, cfg):
    import timm

    item = exported(cfg)
    out = export(item, ExportConfig(format="timm", output=str(tmp_path / "timm"),
                                    repo_id="someone/encoder"))
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json",
                                                     "model.safetensors"]
    loaded = timm.create_model(f"local-dir:{out}", pretrained=True).eval()
    images = torch.randn(4, 3, R, R, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(loaded(images), item.model.features(images), rtol=0,
                                   atol=1e-5)
    view = timm.data.resolve_data_config(model=loaded)
    assert tuple(view["input_size"]) == (3, R, R) and view["crop_pct"] == 0.875  # JSON: lists
    assert tuple(view["mean"]) == MEAN and tuple(view["std"]) == STD
    assert view["interpolation"] == "bilinear"
    card = (out / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: timm\n") and "hf-hub:someone/encoder" in card
    assert "| objective | supcon |" in card
    assert "Not evaluated: exported from a checkpoint or run" in card  # not models:/


@pytest.mark.parametrize(("cfg", "fmt", "message"), [
    (SMALL_CNN, "timm", "export.format=timm: small_cnn is not a timm architecture; this "
                        "encoder exports as onnx"),
    (ModelConfig(backbone="resnet18", projector_hidden=16, projector_dim=8), "timm",
     "export.format=timm: its 32 px stem (model.small_stem=true) is not a timm architecture; "
     "this encoder exports as onnx"),
])
def test_a_format_the_backbone_cannot_take_is_refused_naming_those_it_can(tmp_path, cfg, fmt,
                                                                         message):
    with pytest.raises(RunError) as err:
        export(exported(cfg), ExportConfig(format=fmt, output=str(tmp_path / "out")))
    assert str(err.value) == message
    assert not (tmp_path / "out").exists()


def test_an_output_that_holds_files_is_kept_unless_overwrite(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    cfg = ExportConfig(format="onnx", output=str(out))
    with pytest.raises(RunError, match="not empty; choose another directory or set "
                                       "export.overwrite=true"):
        export(exported(SMALL_CNN), cfg)
    assert (out / "keep.txt").read_text() == "mine"
    cfg.overwrite = True
    export(exported(SMALL_CNN), cfg)
    assert sorted(p.name for p in out.iterdir()) == ["model.onnx", "model.onnx.data"]


def export_command(store, *keys: str) -> list[str]:
    """``export`` arguments for the registered encoder's run (``store``: its mlflow.db)."""
    return [f"output_dir={store.parent.parent}", f"name={store.parent.name}", *keys]


@pytest.mark.parametrize("source", ["models:/served/1", "checkpoint"])
def test_the_command_exports_a_registered_version_or_a_checkpoint(store, tmp_path, capsys,
                                                                  source):
    """The registry's files are checked against their digests before anything is read
    (``evaluation.load``); the export equals the encoder ``evaluate`` would load."""
    import onnxruntime

    from app.export import main
    from evaluation.load import load_encoder

    if source == "checkpoint":
        source = str(sorted((store.parent / "checkpoints").glob("step_*"))[-1])
    main(export_command(store, f"export.model={source}", "export.format=onnx",
                        f"export.output={tmp_path / 'out'}"))
    assert capsys.readouterr().out.startswith(f"export: {source} as onnx (backbone) in ")
    model = load_encoder(source, store.parent, f"sqlite:///{store}").model.eval()
    session = onnxruntime.InferenceSession(str(tmp_path / "out" / "model.onnx"),
                                           providers=["CPUExecutionProvider"])
    images = torch.randn(3, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    (got,) = session.run(None, {"images": images.numpy()})
    with torch.no_grad():
        np.testing.assert_allclose(got, model.features(images).numpy(), rtol=0, atol=1e-4)


@pytest.mark.parametrize(("keys", "line"), [
    (["export.model=models:/served/1", "export.format=keras"],
     "export: configuration error: key 'export.format' (command-line override): unknown "
     "export format 'keras'; choose one of onnx, timm or open_clip"),
    (["export.model=models:/served/1", "export.format=timm"],
     "export: error: export.format=timm: small_cnn is not a timm architecture; this encoder "
     "exports as onnx"),
    (["export.model=models:/absent/1", "export.format=onnx"],
     "export: error: export.model=models:/absent/1: not found in sqlite:///"),
    (["export.format=onnx"], "export: configuration error: key 'export.model': export needs "
                             "a value"),
])
def test_bad_input_is_refused_in_one_line_naming_the_key(store, tmp_path, capsys, keys, line):
    from app.export import main

    with pytest.raises(SystemExit) as exit_info:
        main(export_command(store, *keys, f"export.output={tmp_path / 'out'}"))
    assert exit_info.value.code != 0
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(line), last
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_log_artifact_attaches_the_folder_to_the_run_and_the_card_links_it(store, tmp_path,
                                                                           capsys):
    import mlflow
    import onnxruntime

    from app.export import main

    uri = f"sqlite:///{store}"
    for _ in range(2):  # a second export replaces the files; the card links it once
        main(export_command(store, "export.model=models:/served/1", "export.format=onnx",
                            f"export.output={tmp_path / 'out'}", "export.overwrite=true",
                            "--log-artifact"))
    link = capsys.readouterr().out.strip().splitlines()[-1].rsplit("; attached as ", 1)[1]
    client = mlflow.MlflowClient(uri)
    version = client.get_model_version("served", "1")
    assert link == f"runs:/{version.run_id}/export/onnx"
    assert version.description.count(link) == 1, version.description
    fetched = mlflow.artifacts.download_artifacts(link, dst_path=str(tmp_path / "fetched"),
                                                  tracking_uri=uri)
    onnxruntime.InferenceSession(f"{fetched}/model.onnx", providers=["CPUExecutionProvider"])
