"""The GPU kit's tables: ``gpu.md`` as a run writes it, and the record ``gpu/kit``
(``python -m bench.gpu.record OUT_DIR``) as ``docs/benchmarks.md`` shows it, a view per
part of :data:`bench.gpu.part.PARTS`. A part's title and columns travel with its figures:
a record shows the columns its run measured."""

from __future__ import annotations

import functools
from typing import Any

from bench.gpu.part import PARTS
from bench.records import source_line


def cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 100 else f"{value:,.0f}"
    return "" if value is None else str(value).replace("|", "/")


def table(title: str, status: str, rows: list[dict[str, Any]], columns: tuple[str, ...]
          ) -> list[str]:
    """A part's heading with its status, and its rows under its columns."""
    lines = [f"### {title}: {status}", ""]
    if rows:
        lines += ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        lines += ["| " + " | ".join(cell(row.get(c)) for c in columns) + " |" for row in rows]
    return lines


def part_status(result: dict[str, Any]) -> str:
    return f"{result['status']}, {result['seconds']:.0f} s; {result.get('summary', '')}"


def render_part(name: str, record: dict[str, Any]) -> list[str]:
    """Part ``name`` of a kit run: where and when it ran, then its table."""
    part = record["figures"]["parts"][name]
    return [source_line(record), "",
            *table(part["title"], part_status(part), part["rows"], tuple(part["columns"]))]


VIEWS = {name: functools.partial(render_part, name) for name in PARTS}
