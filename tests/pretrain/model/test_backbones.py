"""Backbones from one factory: the built-in ones and any timm model, built for the run's
image size, rebuilt from the model configuration alone, and with the parameters timm
exempts from weight decay exempted; a timm ViT end to end: pretrain, the registry,
serving and ``evaluate``."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from app.run_config import RunConfig
from core.config import ConfigError, InvalidValue, load_config
from core.errors import RunError
from data_pipeline.digits import DIGIT_NAMES
from pretrain.loop.optim import parameter_groups
from pretrain.model.backbones import (
    BACKBONES,
    TIMM_FAMILY,
    backbone_spec,
    build_backbone,
    check_backbone,
)
from pretrain.model.encoder import ModelConfig, build_model, encoder_from_state
from pretrain.objectives import ObjectiveConfig
from tests.app.helpers import run_pretrain, train_overrides
from tests.data_pipeline.helpers import digit_sample, write_set
from tests.evaluation.test_evaluate import evaluate
from tests.serving.test_inputs import array_rows

VIT = "timm:vit_tiny_patch16_224"


def images(size: int = 32) -> torch.Tensor:
    return torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(0))


BUILT_IN = [name for name in BACKBONES if name != TIMM_FAMILY]


@pytest.mark.parametrize("name", [*BUILT_IN, VIT, "timm:resnet18"])
def test_every_backbone_maps_images_to_its_features(name):
    cfg = ModelConfig(backbone=name, image_size=32, patch_size=4 if name == VIT else 0)
    check_backbone(cfg)
    net, features = build_backbone(cfg)
    net.eval()
    with torch.no_grad():
        out = net(images())
    assert out.shape == (2, features)


def test_a_vit_is_built_for_the_configured_image_and_patch_size():
    net, features = build_backbone(ModelConfig(backbone=VIT, image_size=32, patch_size=4))
    assert features == 192
    assert net.patch_embed.proj.kernel_size == (4, 4)
    assert net.pos_embed.shape == (1, (32 // 4) ** 2 + 1, 192)  # patches and the class token


def test_a_patch_size_a_model_does_not_take_names_the_key():
    with pytest.raises(RunError, match=r"model.patch_size: timm:resnet18 refuses "
                                       r"\{'patch_size': 4\}"):
        build_backbone(ModelConfig(backbone="timm:resnet18", image_size=32, patch_size=4))


def test_timm_kwargs_reach_create_model_from_the_command_line():
    """Pooling and the class token set in the run config, not in code; a keyword the model
    does not take names the key; the key is refused for a built-in backbone."""
    config = load_config(RunConfig, None, [
        f"model.backbone={VIT}", "model.patch_size=4",
        "model.timm_kwargs={global_pool: avg, class_token: false}"])
    assert config.model.timm_kwargs == {"global_pool": "avg", "class_token": False}
    net, features = build_backbone(dataclasses.replace(config.model, image_size=32))
    assert net.global_pool == "avg" and net.cls_token is None
    assert net.pos_embed.shape == (1, (32 // 4) ** 2, 192)  # patches only
    assert net(images()).shape == (2, features)
    with pytest.raises(RunError, match="model.timm_kwargs: timm:vit_tiny_patch16_224 refuses"):
        build_backbone(ModelConfig(backbone=VIT, image_size=32, timm_kwargs={"poolz": 1}))
    with pytest.raises(ConfigError, match="model.timm_kwargs"):
        load_config(RunConfig, None, ["model.timm_kwargs={global_pool: avg}"])


def test_unknown_backbones_name_the_choices():
    with pytest.raises(InvalidValue, match="unknown backbone 'vit'; choose one of small_cnn, "
                                           "resnet18, resnet50 or timm:<model name>"):
        backbone_spec("vit")
    with pytest.raises(InvalidValue, match="timm:no_such_net: timm has no such model"):
        backbone_spec("timm:no_such_net")


@pytest.mark.parametrize("key, value", [("patch_size", 4), ("timm_kwargs", {"a": 1}),
                                        ("vit_stem", "hybrid")])
def test_a_key_the_backbone_does_not_take_is_refused_naming_those_that_do(key, value):
    check_backbone(ModelConfig(backbone=VIT, **{key: value}))
    with pytest.raises(InvalidValue, match="only for timm:<model name> backbones, not resnet18"):
        check_backbone(ModelConfig(backbone="resnet18", **{key: value}))


def test_layer_wise_decay_is_refused_for_a_backbone_that_declares_no_layers():
    assert backbone_spec(VIT).layers and not backbone_spec("small_cnn").layers
    with pytest.raises(ConfigError, match="optim.layer_decay.*not small_cnn"):
        load_config(RunConfig, None, ["optim.layer_decay=0.7"])
    load_config(RunConfig, None, [f"model.backbone={VIT}", "optim.layer_decay=0.7"])


def test_a_timm_encoder_is_rebuilt_from_its_configuration_alone():
    cfg = ModelConfig(backbone=VIT, image_size=32, patch_size=4, projector_hidden=64,
                      projector_dim=32)
    torch.manual_seed(0)
    model = build_model(cfg, ObjectiveConfig(), torch.device("cpu")).eval()
    again = encoder_from_state(cfg, model.state_dict()).eval()
    with torch.no_grad():
        assert torch.equal(model.encoder(images())[1], again(images())[1])


def test_timms_no_weight_decay_is_honoured():
    cfg = ModelConfig(backbone=VIT, image_size=32, patch_size=4)
    model = build_model(cfg, ObjectiveConfig(), torch.device("cpu"))
    decay, plain = parameter_groups(model, weight_decay=0.05)
    exempt = {f"encoder.backbone.{n}" for n in model.encoder.backbone.no_weight_decay()}
    assert {"encoder.backbone.pos_embed", "encoder.backbone.cls_token"} <= exempt
    names = {id(p): n for n, p in model.named_parameters()}
    expected = {n for n, p in model.named_parameters() if p.ndim >= 2 and n not in exempt}
    assert {names[id(p)] for p in decay["params"]} == expected
    assert {names[id(p)] for p in plain["params"]} == set(names.values()) - expected


def test_a_vit_trains_registers_serves_and_evaluates(digits_shards, tmp_path):
    import mlflow

    test_shards = tmp_path / "test-shards"
    write_set(test_shards, [[digit_sample(i) for i in range(360, 420)]], DIGIT_NAMES)
    overrides = train_overrides(digits_shards, tmp_path, **{
        "model.backbone": VIT, "model.patch_size": 4, "optim.name": "adamw", "optim.lr": 1e-3,
        "optim.weight_decay": 0.05, "train.max_steps": 2, "tracking.enabled": True,
        "tracking.system_metrics": False, "tracking.registered_model": "vit-test",
        "eval.train_shards": digits_shards, "eval.test_shards": test_shards,
        "eval.probe_epochs": 2, "eval.save_index": False})
    result = run_pretrain(overrides)
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = tmp_path / "run"
    assert "image_size: 16" in (run_dir / "config.yaml").read_text()  # from data.resolution
    final = sorted((run_dir / "checkpoints").glob("step_*"))[-1] / "shared.pt"
    cfg = ModelConfig(backbone=VIT, image_size=16, patch_size=4, projector_hidden=64,
                      projector_dim=32)
    reference = encoder_from_state(cfg, torch.load(final, weights_only=True)["model"]).eval()
    batch = images(16)
    with torch.no_grad():
        expected = torch.nn.functional.normalize(reference(batch)[1], dim=1)

    # evaluate rebuilds the registered ViT from its configuration alone, as serving does
    # (the registry named by the run's configuration, not by this process's MLflow settings)
    result = evaluate(overrides, "eval.model=models:/vit-test/1",
                      f"eval.output={tmp_path / 'eval'}")
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads((tmp_path / "eval" / "results.json").read_text())
    assert results["samples"] == {"train": 360, "test": 60}
    for space in ("backbone", "projector"):
        for value in results["knn"][space].values():
            assert 0 <= value["top1"] <= value["top5"] <= 1
    assert 0 <= results["linear_probe"]["top1"] <= 1

    mlflow.set_registry_uri(f"sqlite:///{run_dir / 'mlflow.db'}")
    served = mlflow.pyfunc.load_model("models:/vit-test/1")  # rebuilt from its config alone
    torch.testing.assert_close(torch.from_numpy(served.predict(array_rows(batch))), expected)


def test_a_conv_stem_replaces_the_patchify_and_keeps_the_tokens():
    """model.vit_stem=conv: 3x3 stride-2 convolutions then a 1x1 (Xiao et al. 2021) make the
    same [B, D, H / p, W / p] tokens as the p x p patchify, for p = 4 and 8."""
    for patch in (4, 8):
        cfg = ModelConfig(backbone=VIT, image_size=32, patch_size=patch, vit_stem="conv")
        net, features = build_backbone(cfg)
        stem = net.patch_embed.proj
        strides = [m.stride[0] for m in stem if isinstance(m, torch.nn.Conv2d)]
        assert strides == [2] * (patch.bit_length() - 1) + [1]
        assert stem(images()).shape == (2, 192, 32 // patch, 32 // patch)
        assert net(images()).shape == (2, features)
    with pytest.raises(RunError, match="model.vit_stem=conv: timm:resnet18 has no patch"):
        build_backbone(ModelConfig(backbone="timm:resnet18", vit_stem="conv"))
    with pytest.raises(ConfigError, match="model.vit_stem"):
        load_config(RunConfig, None, ["model.vit_stem=conv"])


def test_a_hybrid_stem_tokenises_the_small_cnns_feature_map():
    """model.vit_stem=hybrid: log2(p) of the small CNN's blocks (3x3 stride-1 convolution,
    norm, ReLU, 2x2 max-pool) of width x 1, 2, 4 channels, then a 1x1 to the embedding width:
    the p x p patchify's [B, D, H / p, W / p] tokens, and the same blocks as ``small_cnn``
    (its first log2(p) blocks, parameter for parameter)."""
    for patch in (4, 8):
        cfg = ModelConfig(backbone=VIT, image_size=32, patch_size=patch, vit_stem="hybrid",
                          width=8)
        net, features = build_backbone(cfg)
        stem = net.patch_embed.proj
        convs = [m for m in stem if isinstance(m, torch.nn.Conv2d)]
        stages = patch.bit_length() - 1
        assert [m.out_channels for m in convs] == [8 * 2 ** i for i in range(stages)] + [192]
        assert [m.stride[0] for m in convs] == [1] * (stages + 1)
        assert stem(images()).shape == (2, 192, 32 // patch, 32 // patch)
        assert net(images()).shape == (2, features)
        cnn = build_backbone(ModelConfig(width=8)).net
        assert [p.shape for p in stem[:-1].parameters()] == \
            [p.shape for p in cnn[:4 * stages].parameters()]
        cnn[:4 * stages].load_state_dict(stem[:-1].state_dict())
        torch.testing.assert_close(cnn[:4 * stages].eval()(images()),
                                   stem[:-1].eval()(images()))
    with pytest.raises(RunError, match="model.vit_stem=hybrid needs a square power-of-2"):
        build_backbone(ModelConfig(backbone=VIT, image_size=36, patch_size=6,
                                   vit_stem="hybrid"))
    with pytest.raises(RunError, match="model.vit_stem=hybrid: timm:resnet18 has no patch"):
        build_backbone(ModelConfig(backbone="timm:resnet18", vit_stem="hybrid"))
