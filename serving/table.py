"""The cells of a scoring table, checked as MLflow will read them, so that a well-formed
table MLflow cannot read is refused naming the row and the cell, not with a fixed line.

MLflow's scoring server decodes the signature's binary column ``image`` from base64 text
with ``base64.decodebytes`` (which skips characters outside the alphabet and fails on bad
padding) and refuses anything else in that column with an error that echoes the request.
:func:`table_refusal` applies the same rule to the two table forms our docs show
(``dataframe_records`` and ``dataframe_split``) before MLflow sees them; anything that is
not one of those forms is left to MLflow (and answered with the guard's fixed line)."""

from __future__ import annotations

import binascii
from typing import Any

JSON_TYPES = {type(None): "null", bool: "true or false", int: "a number", float: "a number",
              str: "text", list: "a list", dict: "an object"}


def table_rows(value: Any) -> list[dict[str, Any]] | None:
    """The rows of a ``dataframe_records`` or ``dataframe_split`` body as column -> cell,
    or None for any other body (or a split whose rows do not fit its columns)."""
    if not isinstance(value, dict):
        return None
    records, split = value.get("dataframe_records"), value.get("dataframe_split")
    if isinstance(records, list) and all(isinstance(row, dict) for row in records):
        return records
    if isinstance(split, dict) and isinstance(split.get("columns"), list) \
            and isinstance(split.get("data"), list):
        columns, rows = split["columns"], split["data"]
        if all(isinstance(row, list) and len(row) == len(columns) for row in rows):
            return [dict(zip(map(str, columns), row, strict=True)) for row in rows]
    return None


def table_refusal(value: Any) -> str | None:
    """Why MLflow could not read the table ``value``: a cell (naming the row and the column)
    or its ``params`` (MLflow checks them against the signature's string ``space``); None
    for a body of another form, or a table MLflow reads."""
    rows = table_rows(value)
    if rows is None:
        return None
    params = value.get("params")
    if params is not None and not isinstance(params, dict):
        return f"params: expected an object, got {JSON_TYPES.get(type(params), 'another value')}"
    space = (params or {}).get("space")
    if space is not None and not isinstance(space, str):
        return (f"params.space: expected text (projector or backbone), got "
                f"{JSON_TYPES.get(type(space), 'another value')}")
    for index, row in enumerate(rows):
        if "image" not in row:
            continue
        cell = row["image"]
        if cell is None:
            return (f"row {index}: image: null; leave 'image' out of a row that sets 'path'"
                    if row.get("path") is not None else
                    f"row {index}: set exactly one of 'image' (base64 of an encoded image) "
                    "and 'path' (a file under the server's path root)")
        if not isinstance(cell, str):
            return (f"row {index}: image: expected base64 text of a JPEG, PNG, WebP or .npy "
                    f"file, got {JSON_TYPES.get(type(cell), 'another value')}")
        try:
            binascii.a2b_base64(cell.encode("utf-8", "surrogatepass"))
        except (binascii.Error, ValueError):
            return f"row {index}: image: not valid base64 (its length or padding is wrong)"
    return None
