"""Typed configuration: dataclasses <- YAML file <- ``key=value`` overrides.

Every configurable component defines a dataclass next to its code; the run configuration
(``app/run_config.py``) composes them. This module turns a YAML file plus command-line
overrides into such a dataclass tree, rejecting unknown keys, wrong types and impossible
values *before any work starts*, with a message naming the key and where it came from.

Values are typed by the field they set, not by how YAML would read them on their own: a
string field keeps the text as written (``graph.key=0000170`` stays ``"0000170"``, not the
YAML 1.1 octal 120; ``key=`` is the empty string), an int field reads decimal digits, a
float field accepts ``1e-3``. A dataclass may define ``validate(self) -> None`` that raises
:class:`InvalidValue` naming one of its own fields; the loader prefixes the dotted path and
the source. Each field's trailing ``# comment`` is its one-line description
(:func:`describe`, ``--help-config``). A dataclass's ``MOVED`` mapping (old key -> its new
dotted key below the same section) refuses an old key in one line naming the new one.
"""

from __future__ import annotations

import dataclasses
import re
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

import yaml

from core.fields import field_descriptions

T = TypeVar("T")
_INT = re.compile(r"[-+]?\d+")
_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?|[-+]?(inf|nan)", re.IGNORECASE)
_NULL = ("null", "Null", "NULL", "~")


class ConfigError(ValueError):
    """A configuration problem, with the offending key and its source in the message."""


class InvalidValue(ValueError):
    """Raised by a config dataclass's ``validate`` for one of its fields."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class Plain:
    """A plain (unquoted) YAML scalar: the text as written and YAML's reading of it."""

    text: str
    value: Any

    def __repr__(self) -> str:
        return repr(self.text)


def _from_node(node: yaml.Node | None) -> Any:
    if node is None:
        return Plain("", None)
    if isinstance(node, yaml.MappingNode):
        return {str(key.value): _from_node(value) for key, value in node.value}
    if isinstance(node, yaml.SequenceNode):
        return [_from_node(item) for item in node.value]
    if node.style is None:  # plain scalar: typed later by the field it sets
        return Plain(node.value, yaml.safe_load(node.value) if node.value else None)
    return node.value  # quoted: a string


def read_yaml(text: str) -> Any:
    """YAML text -> nested dicts and lists whose plain scalars are :class:`Plain`."""
    return _from_node(yaml.compose(text, Loader=yaml.SafeLoader))


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """``["a.b=1", "c=x"]`` -> ``{"a": {"b": Plain("1", 1)}, "c": Plain("x", "x")}``."""
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
        try:
            node[parts[-1]] = read_yaml(raw) if raw.strip() else Plain(raw, None)
        except yaml.YAMLError as err:
            raise ConfigError(f"override {item!r}: not a value: {err}") from None
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
    file_tree: Any = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path}: not found")
        try:
            file_tree = read_yaml(path.read_text())
        except yaml.YAMLError as err:
            raise ConfigError(f"config file {path}: not valid YAML: {err}") from err
        if isinstance(file_tree, Plain) and file_tree.value is None:
            file_tree = {}
        if not isinstance(file_tree, dict):
            raise ConfigError(f"config file {path}: top level must be a mapping")
    override_tree = parse_overrides(list(overrides))
    sources = _sources(file_tree, f"file {path}")
    sources.update(_sources(override_tree, "command-line override"))
    return from_dict(cls, _merge(file_tree, override_tree), sources=sources)


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
                          f"mapping for {cls.__name__}, got {tree!r}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    hints = get_type_hints(cls)
    unknown = sorted(set(tree) - set(fields))
    moved = [key for key in unknown if key in getattr(cls, "MOVED", {})]
    if moved:
        raise ConfigError(f"{where(moved[0])}: moved; set '{prefix}{cls.MOVED[moved[0]]}' "
                          "instead")
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
        if isinstance(value, Plain) and value.value is None:
            value = {}
        return from_dict(tp, value, sources, prefix)
    if origin in (Union, types.UnionType):
        return _coerce_union(args, value, sources, prefix)
    if origin is Literal:
        chosen = value.text if isinstance(value, Plain) and all(
            isinstance(a, str) for a in args) else _python(value)
        if chosen not in args:
            raise ValueError(f"must be one of {', '.join(map(repr, args))}, got {value!r}")
        return chosen
    if origin in (list, tuple):
        if not isinstance(value, list | tuple):
            raise TypeError(f"expected a list, got {value!r}")
        item = args[0] if args else Any
        return origin(_coerce(item, v, sources, prefix) for v in value)
    if origin is dict:
        if not isinstance(value, dict):
            raise TypeError(f"expected a mapping, got {value!r}")
        return {str(k): _coerce(args[1] if args else Any, v, sources, prefix)
                for k, v in value.items()}
    if tp is Any:
        return _python(value)
    return _scalar(tp, value)


def _coerce_union(args: tuple, value: Any, sources: dict[str, str], prefix: str) -> Any:
    """``X | None``: null (or an empty value, unless X is str) is None; else X."""
    text_null = isinstance(value, Plain) and (value.text in _NULL or
                                              (value.text == "" and str not in args))
    if type(None) in args and (value is None or text_null):
        return None
    errors = []
    for arg in (a for a in args if a is not type(None)):
        try:
            return _coerce(arg, value, sources, prefix)
        except (TypeError, ValueError) as err:
            errors.append(str(err))
    raise TypeError(" or ".join(errors))


def _scalar(tp: Any, value: Any) -> Any:
    """A str, int, float or bool field from a :class:`Plain` or an already typed value."""
    if isinstance(value, Plain):
        text = value.text.strip()
        if tp is str:
            return value.text
        if tp is int and _INT.fullmatch(text):
            return int(text, 10)  # decimal, also with leading zeros
        if tp is float and _FLOAT.fullmatch(text):
            return float(text)  # YAML 1.1 would read 1e-3 (no dot) as a string
        if tp is bool and isinstance(value.value, bool):
            return value.value
        raise TypeError(f"expected {tp.__name__}, got {value!r}")
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp in (int, float, str, bool) and type(value) is not tp:
        raise TypeError(f"expected {tp.__name__}, got {type(value).__name__} {value!r}")
    return value


def _python(value: Any) -> Any:
    if isinstance(value, Plain):
        return value.value
    if isinstance(value, dict):
        return {k: _python(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_python(v) for v in value]
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


def describe(cls: type, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(dotted key, type, default, one-line description) of every leaf key of ``cls``."""
    rows = []
    hints = get_type_hints(cls)
    descriptions = field_descriptions(cls)
    defaults = cls()
    for f in dataclasses.fields(cls):
        tp, key = hints[f.name], f"{prefix}{f.name}"
        if dataclasses.is_dataclass(tp):
            rows += describe(tp, key + ".")
            continue
        default = getattr(defaults, f.name)
        shown = yaml.safe_dump(default, default_flow_style=True).strip().removesuffix("...")
        rows.append((key, _type_name(tp), shown.strip(), descriptions.get(f.name, "")))
    return rows


def _type_name(tp: Any) -> str:
    origin, args = get_origin(tp), get_args(tp)
    if origin is Literal:
        return "|".join(map(str, args))
    if origin in (Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _type_name(a) for a in args)
    if origin in (list, tuple, dict):
        return f"{origin.__name__}[{', '.join(_type_name(a) for a in args)}]"
    return getattr(tp, "__name__", str(tp))


__all__ = [
    "ConfigError", "InvalidValue", "Plain", "describe", "flatten", "from_dict", "load_config",
    "parse_overrides", "read_yaml", "to_dict", "to_yaml",
]
