"""A CLIP or SigLIP encoder exported as an open_clip folder is loaded by the real open_clip
(``create_model_and_transforms("local-dir:DIR")`` and ``get_tokenizer``) in a fresh
offline process, as a user would, and gives our image and text embeddings within 1e-5
(float32; the projector's batch norms are folded in float64), our tokens exactly, and the
run's temperature (and SigLIP's bias). Encoders whose heads open_clip cannot express are
refused in one line naming the setting."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from core.errors import RunError
from data_pipeline.text import BUNDLED, load_tokenizer, model_path, tokenize
from pretrain.model.encoder import Encoder, ModelConfig
from pretrain.model.text_tower import TextTower, TextTowerConfig
from serving.evaluation_record import EvaluationRecord
from serving.export import BUNDLED_HUB_ID, ExportConfig, Exported, export
from serving.model_registry import EmbeddingModel

CAPTIONS = ["a photo of a cat", "Two dogs   playing in the snow.", "x"]
TEXT = TextTowerConfig(projection_bias=False, max_length=16)
OPEN_CLIP_HEADS = {"projector_hidden": 16, "projector_dim": 8, "projector_activation": "gelu",
                   "text": TEXT}
RESNET = ModelConfig(backbone="resnet18", small_stem=False, **OPEN_CLIP_HEADS)
VIT = ModelConfig(backbone="timm:test_vit", image_size=160, **OPEN_CLIP_HEADS)

LOAD = """
import json, sys
import numpy as np, open_clip, torch
folder, images, captions = sys.argv[1], np.load(sys.argv[2]), json.loads(sys.argv[3])
model, _, preprocess = open_clip.create_model_and_transforms(f"local-dir:{folder}")
tokens = open_clip.get_tokenizer(f"local-dir:{folder}")(captions)
with torch.no_grad():
    np.savez(f"{folder}/loaded.npz", image=model.eval().encode_image(torch.from_numpy(images)),
             text=model.encode_text(tokens), tokens=tokens, scale=model.logit_scale,
             bias=np.nan if model.logit_bias is None else model.logit_bias,
             size=preprocess.transforms[0].size)
"""


def exported(cfg: ModelConfig, objective: dict, resolution: int) -> Exported:
    torch.manual_seed(0)
    model = EmbeddingModel(Encoder(cfg), text=TextTower(cfg.text, cfg.projector_dim))
    with torch.no_grad():  # batch-norm statistics that are not the initial ones
        model.train()(torch.randn(16, 3, resolution, resolution) * 2 + 0.5)
    tree = {"data": {"resolution": resolution}, "objective": objective}
    return Exported(model.eval(), cfg, tree, "runs/test/checkpoints/step_00000010")


def offline_hub_cache(root: Path) -> Path:
    """A Hugging Face cache that holds the sentence model's configuration under its hub id,
    as on a machine that has used it once; nothing is downloaded."""
    repo = root / f"models--{BUNDLED_HUB_ID.replace('/', '--')}"
    (repo / "snapshots" / "0").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0")
    (repo / "snapshots" / "0" / "config.json").write_bytes(
        (Path(model_path(BUNDLED)) / "config.json").read_bytes())
    return root


def open_clip_embeddings(folder: Path, images: torch.Tensor, work: Path) -> dict[str, np.ndarray]:
    """What open_clip, in a fresh offline process, makes of ``folder``: image and text
    embeddings of ``images`` and :data:`CAPTIONS`, tokens, logit scale and bias, image size."""
    np.save(work / "images.npy", images.numpy())
    env = {**os.environ, "HF_HUB_OFFLINE": "1",
           "HF_HUB_CACHE": str(offline_hub_cache(work / "hub"))}
    subprocess.run([sys.executable, "-c", LOAD, str(folder), str(work / "images.npy"),
                    json.dumps(CAPTIONS)], check=True, env=env, timeout=300)
    return dict(np.load(folder / "loaded.npz"))


def assert_same_embeddings(loaded: dict[str, np.ndarray], model: EmbeddingModel,
                           images: torch.Tensor, max_length: int) -> None:
    ours = tokenize(load_tokenizer(BUNDLED), CAPTIONS, max_length)
    np.testing.assert_array_equal(loaded["tokens"], ours["input_ids"].numpy())
    with torch.no_grad():
        image, text = model(images), model.text(**ours)
    np.testing.assert_allclose(loaded["image"], image.numpy(), rtol=0, atol=1e-5)
    np.testing.assert_allclose(loaded["text"], text.numpy(), rtol=0, atol=1e-5)


@pytest.mark.parametrize(("cfg", "objective", "resolution"), [
    (RESNET, {"name": "clip", "temperature": 0.07}, 32),
    (VIT, {"name": "siglip", "temperature": 0.1, "siglip": {"bias": -5.0}}, 160),
], ids=["clip-resnet18", "siglip-vit"])
def test_open_clip_loads_our_image_and_text_embeddings(tmp_path, cfg, objective, resolution):
    item = exported(cfg, objective, resolution)
    out = export(item, ExportConfig(format="open_clip", output=str(tmp_path / "folder")))
    images = torch.randn(3, 3, resolution, resolution, generator=torch.Generator().manual_seed(1))
    loaded = open_clip_embeddings(out, images, tmp_path)
    assert_same_embeddings(loaded, item.model, images, TEXT.max_length)
    assert np.isclose(np.exp(loaded["scale"]), 1 / objective["temperature"])
    bias = objective.get("siglip", {}).get("bias", np.nan)
    np.testing.assert_equal(float(loaded["bias"]), bias)
    assert int(loaded["size"]) == resolution


def test_the_open_clip_card_carries_the_version_s_evaluation(tmp_path):
    from huggingface_hub import ModelCard

    record = EvaluationRecord(date="2026-12-01", run_id="abc", test_shards="test-shards",
                              test_samples=100, train_samples=360, k=20, knn_top1=0.5,
                              probe_top1=0.625, untrained_knn_top1=0.25)
    item = exported(RESNET, {"name": "clip", "temperature": 0.07}, 32)._replace(
        evaluation=record)
    out = export(item, ExportConfig(format="open_clip", output=str(tmp_path / "folder")))
    card = (out / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: open_clip\n")
    assert "| backbone kNN top-1 (k=20) | 50.0% | 25.0% |" in card
    assert "| linear probe top-1 | 62.5% | not measured |" in card
    metrics = {r.metric_name: r.metric_value for r in ModelCard(card).data.eval_results}
    assert metrics == {"kNN top-1 (backbone, k=20)": 0.5, "linear probe top-1": 0.625,
                       "untrained kNN top-1 (backbone, k=20)": 0.25}


@pytest.mark.parametrize(("change", "message"), [
    ({"projector_activation": "relu"},
     "open_clip's heads need model.projector_activation=gelu (this run has relu)"),
    ({"projector_hidden": 32}, "open_clip's heads need model.projector_hidden=16 (this run has "
                               "32)"),
    ({"text": TextTowerConfig()},
     "open_clip's heads need model.text.projection_bias=false (this run has true)"),
    ({"backbone": "timm:test_vit", "image_size": 32},
     "open_clip builds a ViT at its default size (160 px), this one has 32 px"),
])
def test_heads_open_clip_cannot_express_are_refused_naming_the_setting(tmp_path, change,
                                                                       message):
    cfg = ModelConfig(**{**RESNET.__dict__, **change})
    item = exported(cfg, {"name": "clip", "temperature": 0.07}, 32)
    with pytest.raises(RunError) as err:
        export(item, ExportConfig(format="open_clip", output=str(tmp_path / "out")))
    assert str(err.value) == (f"export.format=open_clip: {message}; this encoder exports as "
                              "onnx, timm")
    assert not (tmp_path / "out").exists()


def test_an_encoder_without_a_text_tower_is_refused(tmp_path):
    torch.manual_seed(0)
    item = Exported(EmbeddingModel(Encoder(RESNET)).eval(), RESNET, {}, "checkpoint")
    with pytest.raises(RunError, match="export.format=open_clip: an open_clip folder holds an "
                                       "image and a text tower, and this run has no text "
                                       "tower"):
        export(item, ExportConfig(format="open_clip", output=str(tmp_path / "out")))
