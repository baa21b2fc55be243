"""Typed run configuration: dataclasses <- YAML file <- ``key=value`` overrides.

Every configurable component defines a dataclass next to its code; :class:`RunConfig`
(``pretrain/run_config.py``) composes them. This module turns a YAML file plus command-line
overrides into such a dataclass tree, rejecting unknown keys, wrong types and impossible
values *before any work starts*, with a message naming the key and where it came from.

A dataclass may define ``validate(self) -> None`` that raises :class:`InvalidValue` naming
one of its own fields; the loader prefixes the dotted path and the source.
"""

from __future__ import annotations

import dataclasses
import re
import types
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

import yaml

T = TypeVar("T")
_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


class ConfigError(ValueError):
    """A configuration problem, with the offending key and its source in the message."""


class InvalidValue(ValueError):
    """Raised by a config dataclass's ``validate`` for one of its fields."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """``["a.b=1", "c=x"]`` -> ``{"a": {"b": 1}, "c": "x"}``; values parsed as YAML scalars."""
    tree: dict[str, Any] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r}: expected key=value (nested keys with dots)")
        node = tree
        parts = key.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {part!r} is set to a value and a section")
        node[parts[-1]] = yaml.safe_load(raw) if raw.strip() else None
    return tree


def _merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _sources(tree: dict[str, Any], source: str, prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        out[path] = source
        if isinstance(value, dict):
            out.update(_sources(value, source, path + "."))
    return out


def load_config(cls: type[T], path: str | Path | None = None, overrides: list[str] = ()) -> T:
    """Build ``cls`` from its defaults, then the YAML file at ``path``, then ``overrides``."""
    file_tree: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path}: not found")
        try:
            file_tree = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as err:
            raise ConfigError(f"config file {path}: not valid YAML: {err}") from err
        if not isinstance(file_tree, dict):
            raise ConfigError(f"config file {path}: top level must be a mapping")
    override_tree = parse_overrides(list(overrides))
    sources = _sources(file_tree, f"file {path}")
    sources.update(_sources(override_tree, "command-line override"))
    tree = _merge(file_tree, override_tree)
    return from_dict(cls, tree, sources=sources)


def from_dict(cls: type[T], tree: dict[str, Any], sources: dict[str, str] | None = None,
              prefix: str = "") -> T:
    """Instantiate dataclass ``cls`` from a nested dict, checking keys, types and values."""
    sources = sources or {}

    def where(key: str) -> str:
        path = f"{prefix}{key}"
        return f"key '{path}' ({sources.get(path, 'defaults')})"

    if not isinstance(tree, dict):
        path = prefix.rstrip(".") or "<root>"
        raise ConfigError(f"key '{path}' ({sources.get(path, 'defaults')}): expected a "
                          f"mapping for {cls.__name__}, got {type(tree).__name__} {tree!r}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    hints = get_type_hints(cls)
    unknown = sorted(set(tree) - set(fields))
    if unknown:
        raise ConfigError(
            f"{where(unknown[0])}: unknown key for {cls.__name__}; "
            f"valid keys: {', '.join(sorted(fields))}"
        )
    kwargs: dict[str, Any] = {}
    for name, value in tree.items():
        try:
            kwargs[name] = _coerce(hints[name], value, sources, f"{prefix}{name}.")
        except ConfigError:
            raise
        except (TypeError, ValueError) as err:
            raise ConfigError(f"{where(name)}: {err}") from None
    instance = cls(**kwargs)
    validate = getattr(instance, "validate", None)
    if callable(validate):
        try:
            validate()
        except InvalidValue as err:
            raise ConfigError(f"{where(err.field)}: {err}") from None
    return instance


def _coerce(tp: Any, value: Any, sources: dict[str, str], prefix: str) -> Any:
    origin, args = get_origin(tp), get_args(tp)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value if value is not None else {}, sources, prefix)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(arg, value, sources, prefix)
            except (TypeError, ValueError) as err:
                errors.append(str(err))
        raise TypeError(" or ".join(errors))
    if origin is Literal:
        if value not in args:
            raise ValueError(f"must be one of {', '.join(map(repr, args))}, got {value!r}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, list | tuple):
            raise TypeError(f"expected a list, got {type(value).__name__} {value!r}")
        item = args[0] if args else Any
        return origin(_coerce(item, v, sources, prefix) for v in value)
    if origin is dict:
        if not isinstance(value, dict):
            raise TypeError(f"expected a mapping, got {type(value).__name__}")
        return {str(k): _coerce(args[1] if args else Any, v, sources, prefix)
                for k, v in value.items()}
    if tp is Any:
        return value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str) and _FLOAT.fullmatch(value.strip()):
        return float(value)  # YAML 1.1 reads 1e-3 (no dot) as a string
    if tp in (int, float, str, bool) and (type(value) is not tp):
        raise TypeError(f"expected {tp.__name__}, got {type(value).__name__} {value!r}")
    return value


def to_dict(cfg: Any) -> dict[str, Any]:
    """The resolved configuration as plain nested dicts and lists."""
    return dataclasses.asdict(cfg)


def to_yaml(cfg: Any) -> str:
    """The resolved configuration as YAML text that :func:`load_config` reads back."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def flatten(cfg: Any, sep: str = ".") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``, for MLflow params; lists become strings."""
    out: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, f"{prefix}{sep}{key}" if prefix else str(key))
        else:
            out[prefix] = str(node) if isinstance(node, list | tuple) else node

    walk(to_dict(cfg) if dataclasses.is_dataclass(cfg) else cfg, "")
    return out


__all__ = [
    "ConfigError", "InvalidValue", "load_config", "from_dict", "parse_overrides",
    "to_dict", "to_yaml", "flatten",
]
