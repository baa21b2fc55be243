"""The tables docs/benchmarks.md shows from ``bench.perf.negatives``'s records: ``ratios``
and ``memory`` (perf/tiles), ``peaks`` (perf/peaks) and ``chunks`` (perf/chunks)."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from bench.perf.negatives import MAX_TILED_VS_DENSE, PEAK_N, PEAK_TOLERANCE
from bench.perf.objectives import unshown
from bench.records import source_line

# the docs' cells: words -> case, in two columns of seven
SHOWN = {"infonce": "infonce", "supcon": "supcon", "sincere": "sincere",
         "eps_supinfonce": "eps_supinfonce", "flatnce": "flatnce",
         "holder_flatnce": "holder_flatnce", "clip": "clip",
         "xclr (captions)": "xclr[captions]", "xclr (class graph)": "xclr[class_graph]",
         "projnce centroid": "projnce",
         "projnce kernel": "projnce[projection=kernel, bandwidth=2.0]",
         "projnce median": "projnce[projection=median]",
         "projnce learned": "projnce[projection=learned]", "siglip": "siglip"}



def shown_cases(measured: Collection[str]) -> dict[str, str]:
    """The docs' cells: :data:`SHOWN`, then each :func:`unshown` case by its label."""
    return {**SHOWN, **{case: case for case in unshown(measured, SHOWN.values())}}


def render_ratios(record: dict[str, Any]) -> list[str]:
    """The source, each of :func:`shown_cases`' dense time and tiled over dense time at
    N = RATIO_N, and the target over every case measured."""
    return [source_line(record), "", *_ratio_lines(record["figures"])]


def render_memory(record: dict[str, Any]) -> list[str]:
    """The source, and infonce's time and peak resident memory against N, dense and
    tiled."""
    return [source_line(record), "", *_memory_lines(record["figures"])]


def _ratio_lines(figures: dict[str, Any]) -> list[str]:
    rows = {r["objective"]: r for r in figures["objectives"]}
    cells = [f"{words} | {rows[case]['dense_ms']:,.0f} | {rows[case]['tiled_vs_dense']:.2f}"
             for words, case in shown_cases(rows).items()]
    half = (len(cells) + 1) // 2
    cells += [" | | "] * (2 * half - len(cells))  # an odd count leaves the last cell empty
    worst = max(rows.values(), key=lambda r: r["tiled_vs_dense"])
    met = worst["tiled_vs_dense"] <= MAX_TILED_VS_DENSE
    return ["| objective | dense ms | tiled / dense | objective | dense ms | tiled / dense |",
            "| --- | --- | --- | --- | --- | --- |",
            *(f"| {left} | {right} |"
              for left, right in zip(cells[:half], cells[half:], strict=True)),
            "", f"Target, tiled within {MAX_TILED_VS_DENSE}x of dense for each of the "
            f"{len(rows)} cases (every objective and setting): **{'met' if met else 'not met'}"
            f"** (largest {worst['tiled_vs_dense']:.2f}x, {worst['objective']})."]


def _memory_lines(figures: dict[str, Any]) -> list[str]:
    by_size: dict[int, dict[str, dict]] = {}
    for row in figures["scaling"]:
        by_size.setdefault(row["N"], {})[row["path"]] = row
    idle = [r["idle_gib"] for r in figures["scaling"] if r["fits"]]

    def cells(row: dict) -> str:
        return (f"{row['seconds']:.3g} | {row['peak_gib']:.2f}" if row["fits"]
                else "does not fit | ")
    return [f"Peak VmHWM, the idle process {min(idle):.2f}-{max(idle):.2f} GiB "
            f"(T = {figures['tile_size']}):", "",
            "| N | dense s | dense peak GiB | tiled s | tiled peak GiB |",
            "| --- | --- | --- | --- | --- |",
            *(f"| {n:,} | {cells(paths['dense'])} | {cells(paths['tiled'])} |"
              for n, paths in sorted(by_size.items()))]


def render_peaks(record: dict[str, Any]) -> list[str]:
    """The source, then one sentence: what each objective adds to its idle process at
    N = PEAK_N, tile size by tile size, and the target against the budgets
    (``RECORDED_ABOVE_IDLE_GIB``; memory alone: a peak is the same on busy cores)."""
    rows = record["figures"]["rows"]
    met = all(r["above_idle_gib"] <= PEAK_TOLERANCE * r["recorded_above_idle_gib"]
              for r in rows)
    objectives = list(dict.fromkeys(r["objective"] for r in rows))

    def per_objective(key: str) -> str:
        return ", ".join(name + " " + " / ".join(f"{r[key]:.2f}" for r in rows
                                                  if r["objective"] == name)
                         for name in objectives)

    tiles = " / ".join(f"{r['tile_size']:,}" for r in rows if r["objective"] == objectives[0])
    return [f"{source_line(record)} At N = {PEAK_N:,}, each in a fresh process, GiB above the "
            f"idle process at T = {tiles}: {per_objective('above_idle_gib')}; target, each at "
            f"most {PEAK_TOLERANCE}x its budget ({per_objective('recorded_above_idle_gib')}): "
            f"**{'met' if met else 'not met'}**."]


def render_chunks(record: dict[str, Any]) -> list[str]:
    """The source, and the chunked step's time and peak memory against the plain step."""
    def chunk(size: int | str) -> str:
        return "off (plain step)" if size == "off" else f"{size:,}"
    return [source_line(record), "",
            "| chunk size | s / step | peak GiB | time / plain | memory above idle / plain |",
            "| --- | --- | --- | --- | --- |",
            *(f"| {chunk(r['chunk_size'])} | {r['seconds']:.1f} | {r['peak_gib']:.2f} | "
              f"{r['time_vs_plain']:.2f} | {r['memory_vs_plain']:.2f} |"
              for r in record["figures"]["rows"])]


VIEWS = {"ratios": render_ratios, "memory": render_memory, "peaks": render_peaks,
         "chunks": render_chunks}
