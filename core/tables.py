"""The one lookup every table of extensions uses (objectives, backbones, engines).

Each kind of extension is one ``dict[str, <Kind>Spec]`` in the module that defines the
kind: an entry names the code that builds it and declares what it needs from the run, and
the run reads the declaration instead of checking names (docs/architecture.md, "Adding an
objective"). A name that is not in the table fails with one line naming the configuration
key and the choices.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

from core.config import InvalidValue

Spec = TypeVar("Spec")


def table_entry(table: Mapping[str, Spec], name: str, key: str, kind: str) -> Spec:
    """``table[name]``; else :class:`InvalidValue` for ``key``: "unknown <kind> 'x'; choose
    one of a, b or c"."""
    if name not in table:
        *first, last = table
        choices = f"{', '.join(first)} or {last}" if first else last
        raise InvalidValue(key, f"unknown {kind} {name!r}; choose one of {choices}")
    return table[name]
