"""Typed configuration: YAML plus overrides, keys, types and values checked with the key
and its source named; values typed by the field they set; descriptions from comments."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest

from core.config import (
    ConfigError,
    InvalidValue,
    describe,
    flatten,
    load_config,
    parse_overrides,
    to_yaml,
)


@dataclass
class Inner:
    rate: float = 0.01  # how fast
    target: float | None = None  # where to; null: nowhere

    def validate(self) -> None:
        if self.target is not None and not 0 < self.target <= 1:
            raise InvalidValue("target", f"lies in (0, 1], got {self.target}")


@dataclass
class Section:
    name: str = "a"  # a name
    temperature: float = 0.1  # tau
    count: int | None = None  # how many; null = all
    kind: Literal["x", "y"] = "x"  # which kind
    inner: Inner = field(default_factory=Inner)  # nested

    def validate(self) -> None:
        if not self.temperature > 0:
            raise InvalidValue("temperature", f"must be > 0, got {self.temperature}")


@dataclass
class Root:
    seed: int = 0  # the seed
    key: str = ""  # a string key
    path: str | None = None  # an optional path
    sizes: list[int] = field(default_factory=lambda: [1, 2])  # a list
    section: Section = field(default_factory=Section)  # a section


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def test_defaults_file_and_overrides_compose(tmp_path):
    path = write(tmp_path, "section:\n  name: b\n  temperature: 0.2\n")
    cfg = load_config(Root, path, ["section.temperature=0.05", "seed=3", "section.count=16"])
    assert cfg.section.name == "b" and cfg.section.temperature == 0.05
    assert cfg.seed == 3 and cfg.section.count == 16
    assert cfg.section.inner.rate == 0.01  # default kept


@pytest.mark.parametrize(("text", "overrides", "needle"), [
    ("section:\n  temprature: 0.1\n", [], "key 'section.temprature' (file "),
    ("", ["section.temperature=-0.1"], "key 'section.temperature' (command-line override)"),
    ("section:\n  temperature: cold\n", [], "key 'section.temperature'"),
    ("seed: 1.5\n", [], "key 'seed'"),
    ("", ["section.kind=z"], "must be one of 'x', 'y'"),
    ("section:\n  inner:\n    target: 2\n", [], "key 'section.inner.target'"),
    ("section: 3\n", [], "key 'section'"),
    ("", ["sizes=4"], "(command-line override): expected a list, got '4'"),
])
def test_bad_values_name_the_key_and_source(tmp_path, text, overrides, needle):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_config(Root, path, overrides)
    assert needle in str(err.value)
    if "(file " in needle:
        assert str(path) in str(err.value)


def test_missing_file_and_bad_yaml_name_the_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(Root, tmp_path / "absent.yaml")
    with pytest.raises(ConfigError, match="run.yaml: not valid YAML"):
        load_config(Root, write(tmp_path, "section: [\n"))
    with pytest.raises(ConfigError, match="expected key=value"):
        parse_overrides(["section.temperature"])


def test_strings_keep_their_text_and_empty_sets_the_empty_string(tmp_path):
    cfg = load_config(Root, None, ["key=0000170", "section.name=", "path=", "seed=010"])
    assert cfg.key == "0000170"  # not YAML 1.1's octal 120
    assert cfg.section.name == "" and cfg.path == ""
    assert cfg.seed == 10  # int fields read decimal digits
    cfg = load_config(Root, write(tmp_path, "key: 0000170\nsection:\n  name: yes\n"))
    assert cfg.key == "0000170" and cfg.section.name == "yes"
    assert load_config(Root, None, ["path=null"]).path is None
    assert load_config(Root, None, ["section.count="]).section.count is None


def test_numbers_by_field_type():
    cfg = load_config(Root, None, ["section.temperature=1e-3", "section.inner.rate=2E-1",
                                   "section.count=null"])
    assert cfg.section.temperature == 1e-3 and cfg.section.inner.rate == 0.2
    assert cfg.section.count is None
    assert load_config(Root, None, ["section.temperature=1"]).section.temperature == 1.0
    with pytest.raises(ConfigError, match="section.temperature"):
        load_config(Root, None, ["section.temperature=1e-3x"])
    assert load_config(Root, None, ["sizes=[3, 04]"]).sizes == [3, 4]


def test_yaml_round_trip_and_flatten(tmp_path):
    cfg = load_config(Root, None, ["section.kind=y", "key=007"])
    again = load_config(Root, write(tmp_path, to_yaml(cfg)))
    assert again == cfg
    flat = flatten(cfg)
    assert flat["section.kind"] == "y" and flat["section.inner.rate"] == 0.01
    assert flat["sizes"] == "[1, 2]"
    assert all(not isinstance(v, dict) for v in flat.values())


def test_describe_lists_every_leaf_with_default_and_comment():
    rows = {key: (type_name, default, text) for key, type_name, default, text in describe(Root)}
    assert set(rows) == {"seed", "key", "path", "sizes", "section.name", "section.temperature",
                         "section.count", "section.kind", "section.inner.rate",
                         "section.inner.target"}
    assert rows["section.temperature"] == ("float", "0.1", "tau")
    assert rows["section.count"] == ("int or null", "null", "how many; null = all")
    assert rows["section.kind"][0] == "x|y"
    assert rows["key"][1] == "''"
