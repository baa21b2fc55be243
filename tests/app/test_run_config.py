"""The run configuration and the stages' command lines: shipped recipes load, every key
is described, and a stage fails before any work on a bad or missing value, naming it."""

from __future__ import annotations

import dataclasses
import importlib
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from app.run_config import RunConfig, check_stage
from core.config import ConfigError, describe, load_config
from core.fields import field_descriptions

CONFIGS = sorted(Path("launch/configs").rglob("*.yaml"))  # recipes in sub-folders too
STAGES = {"app.pretrain": "pretrain", "app.make_shards": "make-shards",
          "app.graph_precompute": "graph-precompute", "app.evaluate": "evaluate"}


def config_classes(cls: type) -> list[type]:
    out = [cls]
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(f.type if isinstance(f.type, type) else None):
            out += config_classes(f.type)
    return out


@pytest.mark.parametrize("path", CONFIGS,
                         ids=[str(p.relative_to("launch/configs")) for p in CONFIGS])
def test_every_shipped_recipe_has_what_its_stages_need(path):
    """A ``*_shards.yaml`` recipe makes shards; every other recipe trains and evaluates
    (so each carries its own eval section)."""
    config = load_config(RunConfig, path)
    stages = ["make-shards"] if path.name.endswith("_shards.yaml") else ["pretrain", "evaluate"]
    if path.name == "demo.yaml":
        stages = list(STAGES.values())
    for stage in stages:
        check_stage(config, stage)


def test_the_recipe_list_reaches_every_folder():
    folders = {p.parent for p in Path("launch/configs").rglob("*.yaml")}
    assert folders == {p.parent for p in CONFIGS} >= {Path("launch/configs/cluttered")}


def test_every_key_has_a_description():
    rows = describe(RunConfig)
    assert len(rows) > 100
    missing = [key for key, _, _, text in rows if not text]
    assert not missing, f"keys without a '# description' comment: {missing}"
    sections = {key.split(".")[0] for key, *_ in rows}
    assert {"data", "model", "objective", "train", "eval"} <= sections
    assert "batch_size" in field_descriptions(type(RunConfig().data))


@pytest.mark.parametrize(("stage", "overrides", "key"), [
    ("pretrain", ["data.shards=x"], "name"),
    ("pretrain", ["name=r"], "data.shards"),
    ("make-shards", ["shards.source=digits"], "shards.output"),
    ("evaluate", ["name=r", "eval.train_shards=a"], "eval.test_shards"),
    ("graph-precompute", ["graph.output=o"], "graph.shards"),
    ("pretrain", ["name=r", "data.shards=x", "objective.name=xclr"], "objective.xclr.class_graph"),
    # what the tables' entries need: a source, a graph task, a data backend
    ("make-shards", ["shards.source=imagenet", "shards.output=o"], "shards.input"),
    ("make-shards", ["shards.source=cluttered_digits", "shards.output=o"], "shards.split"),
    ("make-shards", ["shards.source=folders", "shards.output=o"], "shards.source"),
    ("graph-precompute", ["graph.output=o", "graph.task=show"], "graph.key"),
    ("graph-precompute", ["graph.output=o", "graph.task=class_graph"], "graph.shards"),
    ("graph-precompute", ["graph.output=o", "graph.task=edges"], "graph.task"),
    ("pretrain", ["name=r", "data.shards=x", "data.backend=gpu"], "data.backend"),
])
def test_a_stage_names_the_key_it_lacks(stage, overrides, key):
    config = load_config(RunConfig, None, overrides)
    with pytest.raises(ConfigError, match=f"key '{key}'"):
        check_stage(config, stage)


def test_library_defaults_name_no_data():
    paths = [value for key, _, value, _ in describe(RunConfig)
             if key.endswith(("shards", "output", "class_graph", "caption_store"))]
    assert all(value in ("''", "runs") for value in paths), paths


def exit_status(main: Callable[[list[str]], None], argv: list[str]) -> int:
    with pytest.raises(SystemExit) as stop:
        main(argv)
    return stop.value.code


@pytest.mark.parametrize("module", sorted(STAGES))
def test_stage_commands_validate_before_any_work(module, capsys):
    """Each stage's ``main``, in this process, with the arguments ``python -m`` would pass
    it (an interpreter of its own runs the command line in the test below)."""
    main = importlib.import_module(module).main
    assert exit_status(main, ["--config", "launch/configs/demo.yaml", "--print-config",
                              "objective.temperature=0.3"]) == 0
    assert "temperature: 0.3" in capsys.readouterr().out
    assert exit_status(main, ["objective.temprature=0.3"]) == 2
    bad = capsys.readouterr().err
    assert "objective.temprature" in bad and "command-line override" in bad
    assert exit_status(main, []) == 2
    assert f"{STAGES[module]} needs a value" in capsys.readouterr().err


def test_help_points_at_every_key_and_help_config_lists_them(capsys):
    """``--help`` from a fresh interpreter (the command line as a user starts it), then
    ``--help-config`` by ``main`` in this process."""
    usage = subprocess.run([sys.executable, "-m", "app.pretrain", "--help"],
                           capture_output=True, text=True)
    assert usage.returncode == 0 and "--help-config" in usage.stdout
    assert exit_status(importlib.import_module("app.pretrain").main, ["--help-config"]) == 0
    listing = capsys.readouterr().out
    line = next(row for row in listing.splitlines() if row.startswith("data.batch_size"))
    assert "images a chunk" in line and "default: 64" in line


def test_zero_padded_keys_stay_strings():
    cfg = load_config(RunConfig, None, ["graph.key=0000170", "objective.xclr.class_graph="])
    assert cfg.graph.key == "0000170" and cfg.objective.xclr.class_graph == ""


def test_the_image_size_resolves_from_the_data_resolution_unless_set():
    config = load_config(RunConfig, None, ["data.resolution=48"])
    assert config.model.image_size == 48
    config = load_config(RunConfig, None, ["data.resolution=48", "model.image_size=32"])
    assert config.model.image_size == 32


def test_a_timm_backbone_is_checked_at_configuration_time():
    config = load_config(RunConfig, None, ["model.backbone=timm:vit_small_patch16_224"])
    assert config.model.backbone == "timm:vit_small_patch16_224"
    with pytest.raises(ConfigError, match="model.backbone"):
        load_config(RunConfig, None, ["model.backbone=timm:vit_enormous"])


def test_projnce_projections_are_run_options_and_others_are_refused():
    config = load_config(RunConfig, None, ["objective.name=projnce",
                                           "objective.projnce.projection=learned"])
    assert config.objective.projnce.projection == "learned"
    with pytest.raises(ConfigError, match="objective.projnce.projection"):
        load_config(RunConfig, None, ["objective.name=projnce", "objective.projnce.projection=mlp"])


@pytest.mark.parametrize(("old", "new"), [
    ("objective.target_temperature", "objective.xclr.target_temperature"),
    ("objective.class_graph", "objective.xclr.class_graph"),
    ("objective.bias", "objective.siglip.bias"),
    ("objective.projection", "objective.projnce.projection")])
def test_an_objective_key_that_moved_into_its_section_is_refused_naming_the_new_key(old, new):
    with pytest.raises(ConfigError) as err:
        load_config(RunConfig, None, [f"{old}=0.2"])
    assert str(err.value) == (f"key '{old}' (command-line override): moved; set '{new}' "
                              "instead")


@pytest.mark.parametrize("made", [True, False, None], ids=["centred", "plain", "no-key"])
def test_a_caption_store_made_otherwise_than_graph_center_says_is_refused(tmp_path, made):
    """graph.center is the recipe's word on its store: a store whose meta.json says
    otherwise (an older store without the key is uncentred) fails before any work, naming
    the key; an unreadable one is left to the loader."""
    meta = {"model": "bundled"} | ({} if made is None else {"center": made})
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    base = ["name=r", "data.shards=x", "objective.name=xclr",
            f"data.caption_store={tmp_path}"]
    for center in (True, False):
        config = load_config(RunConfig, None, [*base, f"graph.center={center}"])
        if center == bool(made):
            check_stage(config, "pretrain")
        else:
            with pytest.raises(ConfigError, match="key 'graph.center'.*graph-precompute"):
                check_stage(config, "pretrain")
    (tmp_path / "meta.json").write_text("[" * 100_000)
    check_stage(load_config(RunConfig, None, [*base, "graph.center=true"]), "pretrain")
    (tmp_path / "meta.json").unlink()
    (tmp_path / "meta.json").symlink_to("/dev/zero")  # endless: read no further than 1 MiB
    check_stage(load_config(RunConfig, None, [*base, "graph.center=true"]), "pretrain")
