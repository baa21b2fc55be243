"""One-line descriptions of configuration fields, read from their trailing comments.

A config dataclass documents each field where it is declared::

    batch_size: int = 64  # images per rank per step; each yields two views

so the text a reader sees in the code is the text ``--help-config`` prints.
"""

from __future__ import annotations

import dataclasses
import inspect
import io
import textwrap
import tokenize
from functools import cache


def field_descriptions(cls: type) -> dict[str, str]:
    """{field name: its trailing comment} for the fields of dataclass ``cls``, including
    fields it inherits from dataclass bases."""
    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass):
            out.update(_own_descriptions(klass))
    return out


@cache
def _own_descriptions(cls: type) -> dict[str, str]:
    names = {f.name for f in dataclasses.fields(cls)}
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):  # made by make_dataclass: its fields are sections
        return {}
    first_name: dict[int, str] = {}  # line -> first name token at class-body indentation
    comments: dict[int, str] = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        line, column = token.start
        if token.type == tokenize.NAME and column == 4 and line not in first_name:
            first_name[line] = token.string
        elif token.type == tokenize.COMMENT:
            comments[line] = token.string.lstrip("#").strip()
    return {first_name[line]: text for line, text in comments.items()
            if first_name.get(line) in names}
