"""A CLIP or SigLIP encoder exported as an open_clip folder is loaded by the real open_clip
(``create_model_and_transforms("local-dir:DIR")`` and ``get_tokenizer``) in a fresh
offline process, as a user would, and gives our image and text embeddings within 1e-5
(float32; the projector's batch norms are folded in float64), our tokens exactly, and the
run's temperature (and SigLIP's bias). Encoders whose heads open_clip cannot express are
refused in one line naming the setting."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from core.errors import RunError
from data_pipeline.text import BUNDLED, load_tokenizer, model_path, tokenize
from pretrain.model.encoder import Encoder, ModelConfig
from pretrain.model.text_tower import TextTower, TextTowerConfig
from registry.evaluation_record import EvaluationRecord
from registry.package import EmbeddingModel
from serving.export import BUNDLED_HUB_ID, ExportConfig, Exported, export
from serving.open_clip_folder import folded_projector

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
    far_statistics(model.encoder.projector)
    tree = {"data": {"resolution": resolution}, "objective": objective}
    return Exported(model.eval(), cfg, tree, "runs/test/checkpoints/step_00000010")


def far_statistics(projector: torch.nn.Module, seed: int = 0) -> None:
    """Running statistics and affine parameters far from (0, 1): variances in [1e-4, 1e-2],
    where eps (1e-5) moves the scale by 0.05-5%, means and shifts of a few units, so a fold
    that drops eps or misplaces a term is off by far more than any test's tolerance."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for bn in (m for m in projector.modules() if isinstance(m, torch.nn.BatchNorm1d)):
            n = bn.num_features
            bn.running_var.copy_(10 ** (-4 + 2 * torch.rand(n, generator=gen)))
            bn.running_mean.copy_(3 * torch.randn(n, generator=gen))
            if bn.affine:
                bn.weight.copy_(1 + torch.randn(n, generator=gen))
                bn.bias.copy_(2 * torch.randn(n, generator=gen))


@pytest.mark.parametrize("bn_out", [True, False], ids=["bn-out", "no-bn-out"])
def test_the_folded_projector_equals_the_projector_in_float64(bn_out):
    """The fold against the eval-mode projector itself, in float64 on statistics far from
    (0, 1): the error is float64 rounding only (within 1e-12), so a missing eps (a relative
    error of 5e-4 to 5e-2 here) or a misplaced term fails."""
    cfg = dataclasses.replace(RESNET, projector_bn_out=bn_out)
    projector = Encoder(cfg).projector.double().eval()
    far_statistics(projector)
    folded = folded_projector(projector)
    features = torch.randn(32, projector[0].in_features, dtype=torch.float64,
                           generator=torch.Generator().manual_seed(1))
    hidden = F.gelu(features @ folded["fc1.weight"].T + folded["fc1.bias"])
    got = hidden @ folded["fc2.weight"].T + folded["fc2.bias"]
    with torch.no_grad():
        want = projector(features)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


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
    # float32 in two implementations, on embeddings of up to a few hundred (the projector's
    # statistics are far from (0, 1)): 2e-6 relative seen; a fold without eps is off by >1e-4
    np.testing.assert_allclose(loaded["image"], image.numpy(), rtol=2e-5, atol=1e-5)
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
