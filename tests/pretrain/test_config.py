"""Run configuration: YAML plus overrides, unknown keys, types and values rejected with the
key and its source named, round trips through YAML and flattening."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pretrain.config import ConfigError, flatten, load_config, parse_overrides, to_yaml
from pretrain.run_config import RunConfig

CONFIGS = sorted(Path("launch/configs").glob("*.yaml"))


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def test_defaults_file_and_overrides_compose(tmp_path):
    path = write(tmp_path, "objective:\n  name: sincere\n  temperature: 0.2\n")
    cfg = load_config(RunConfig, path, ["objective.temperature=0.05", "seed=3",
                                        "objective.num_negatives=16"])
    assert cfg.objective.name == "sincere"
    assert cfg.objective.temperature == 0.05 and cfg.seed == 3
    assert cfg.objective.num_negatives == 16
    assert cfg.objective.target_temperature == 0.1  # default kept


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_shipped_config_loads(path):
    assert load_config(RunConfig, path).name


@pytest.mark.parametrize(("text", "overrides", "needle"), [
    ("objective:\n  temprature: 0.1\n", [], "key 'objective.temprature' (file "),
    ("", ["objective.temperature=-0.1"], "key 'objective.temperature' (command-line override)"),
    ("objective:\n  name: simclr\n", [], "unknown objective 'simclr'"),
    ("objective:\n  temperature: cold\n", [], "key 'objective.temperature'"),
    ("seed: 1.5\n", [], "key 'seed'"),
    ("", ["objective.num_negatives=0"], "key 'objective.num_negatives'"),
    ("", ["objective.projection=mean"], "must be one of 'centroid'"),
    ("objective:\n  ess_control:\n    target: 2\n", [], "key 'objective.ess_control.target'"),
    ("objective: 3\n", [], "key 'objective'"),
])
def test_bad_configs_name_the_key_and_source(tmp_path, text, overrides, needle):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_config(RunConfig, path, overrides)
    assert needle in str(err.value)
    if "(file " in needle:
        assert str(path) in str(err.value)


def test_missing_file_and_bad_yaml_name_the_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(RunConfig, tmp_path / "absent.yaml")
    with pytest.raises(ConfigError, match="run.yaml: not valid YAML"):
        load_config(RunConfig, write(tmp_path, "objective: [\n"))
    with pytest.raises(ConfigError, match="expected key=value"):
        parse_overrides(["objective.temperature"])


def test_yaml_round_trip_and_flatten(tmp_path):
    cfg = load_config(RunConfig, None, ["objective.name=projnce", "objective.projection=kernel"])
    again = load_config(RunConfig, write(tmp_path, to_yaml(cfg)))
    assert again == cfg
    flat = flatten(cfg)
    assert flat["objective.projection"] == "kernel"
    assert flat["objective.ess_control.rate"] == 0.01
    assert all(not isinstance(v, dict) for v in flat.values())


def test_null_override_and_int_for_float():
    cfg = load_config(RunConfig, None, ["objective.num_negatives=null",
                                        "objective.temperature=1"])
    assert cfg.objective.num_negatives is None
    assert cfg.objective.temperature == 1.0 and isinstance(cfg.objective.temperature, float)


@pytest.mark.parametrize("module", ["pretrain.train", "data_pipeline.make_shards",
                                    "data_pipeline.graph_precompute", "evaluation.evaluate"])
def test_stage_commands_validate_before_any_work(module):
    ok = subprocess.run([sys.executable, "-m", module, "--config", "launch/configs/demo.yaml",
                         "--print-config", "objective.temperature=0.3"],
                        capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert "temperature: 0.3" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", module, "objective.temprature=0.3"],
                         capture_output=True, text=True)
    assert bad.returncode == 2
    assert "objective.temprature" in bad.stderr and "command-line override" in bad.stderr


def test_exponent_floats_without_a_dot_are_floats():
    cfg = load_config(RunConfig, None, ["objective.temperature=1e-3", "optim.lr=2E-1"])
    assert cfg.objective.temperature == 1e-3 and cfg.optim.lr == 0.2
    with pytest.raises(ConfigError, match="objective.temperature"):
        load_config(RunConfig, None, ["objective.temperature=1e-3x"])
