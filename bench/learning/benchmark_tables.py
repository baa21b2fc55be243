"""The learning benchmark's record (``python -m bench.learning --part PART --record``, kept
as ``learning/PART``) and its views as ``docs/learning.md`` shows them.

The record keeps, per configuration and seed, the figures the pages show and the run's own
provenance (a run made at another commit than the gathering keeps its own), and the
claims as ``bench/learning/claims.py`` checked them. Runs finished in earlier sessions are
gathered by ``--report-only``: the record holds the runs the folder holds.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from typing import Any

from bench.learning.claims import Results, diagnostic, knn, probe, verdict
from bench.records import source_line


def _or_none(metric: Callable[[dict[str, Any]], float], result: dict[str, Any]) -> float | None:
    try:
        return metric(result)
    except (KeyError, TypeError):
        return None


RUN_FIGURES: dict[str, Callable[[dict[str, Any]], float]] = {
    "knn": knn,
    "knn_projector": lambda r: knn(r, "projector"),
    "probe": probe,
    "margin_projector": diagnostic("margin", "projector"),
    "class_mean_cosine": diagnostic("class_mean_cosine", "projector"),
    "intra_class_variance": diagnostic("intra_class_variance", "projector"),
    "retrieval_r1": lambda r: r["evaluation"]["retrieval"]["image_to_text"]["R@1"],
    "zero_shot": lambda r: r["evaluation"]["zero_shot"]["accuracy"]["top1"],
}


def run_figures(result: dict[str, Any]) -> dict[str, Any]:
    """A finished run's figures (None where its evaluation lacks one) and its provenance."""
    seen = result.get("provenance") or {}
    return {**{name: _or_none(metric, result) for name, metric in RUN_FIGURES.items()},
            "commit": seen.get("commit"), "date": seen.get("date"),
            "cpu": (seen.get("machine") or {}).get("cpu")}


def figures(results: Results, claims: list[dict[str, Any]]) -> dict[str, Any]:
    """What the record keeps: {configuration: {seed: figures}} of the evaluated runs, their
    order as the benchmark ran them (a record's keys are sorted), and the claims."""
    runs: dict[str, dict[str, Any]] = {}
    for name, found in results.items():
        for result in found:
            if "evaluation" in result:
                seed = str(result["configuration"]["seed"])
                runs.setdefault(name, {})[seed] = run_figures(result)
    return {"runs": runs, "order": list(runs), "claims": claims}


def values(record: dict[str, Any], name: str, figure: str) -> list[float]:
    """``figure`` of each seed of ``name`` that has it, in seed order."""
    seeds = record["figures"]["runs"].get(name, {})
    return [seeds[s][figure] for s in sorted(seeds, key=int) if seeds[s][figure] is not None]


def mean(found: list[float]) -> str:
    """The mean over the seeds, blank for none."""
    return f"{statistics.fmean(found):.3f}" if found else ""


def mean_sd(found: list[float], digits: int = 3, sign: str = "") -> str:
    """'mean ± sd' over the seeds, the mean alone for one seed, blank for none."""
    if not found:
        return ""
    mean = f"{statistics.fmean(found):{sign}.{digits}f}"
    return f"{mean} ± {statistics.stdev(found):.{digits}f}" if len(found) > 1 else mean


def commits(record: dict[str, Any], names: list[str]) -> str:
    """Where the shown runs ran: their commits and dates, and how many predate provenance."""
    shown = [f for name in names for f in record["figures"]["runs"].get(name, {}).values()]
    known = sorted({f["commit"][:7] for f in shown if f["commit"]})
    dates = sorted({f["date"] for f in shown if f["date"]})
    unknown = sum(1 for f in shown if not f["commit"])
    parts = [f"{len(shown)} runs"]
    if known:
        parts.append(f"at {', '.join(known)}, {dates[0]}"
                     + (f" to {dates[-1]}" if dates[-1] != dates[0] else ""))
    if unknown:
        parts.append(f"{unknown} without a recorded commit")
    return "; ".join(parts) + "."


MAIN_COLUMNS = (("kNN (backbone)", "knn", True), ("kNN (projector)", "knn_projector", True),
                ("linear probe", "probe", True),
                ("class-mean cosine (projector)", "class_mean_cosine", False),
                ("intra-class variance (projector)", "intra_class_variance", False))


def _table(record: dict[str, Any], names: list[str]) -> list[str]:
    """``names`` with their seeds; kNN and probe as mean ± sd, the geometry as the mean."""
    lines = [source_line(record), commits(record, names), "",
             "| configuration | seeds | " + " | ".join(t for t, _, _ in MAIN_COLUMNS) + " |",
             "| --- | --- |" + " --- |" * len(MAIN_COLUMNS)]
    for name in names:
        cells = [(mean_sd if spread else mean)(values(record, name, key))
                 for _, key, spread in MAIN_COLUMNS]
        seeds = len(record["figures"]["runs"][name])
        lines.append(f"| {name} | {seeds} | " + " | ".join(cells) + " |")
    return lines


def render_main(record: dict[str, Any]) -> list[str]:
    """``main``: every configuration of the record but the alt-text, sweep and plain-digit
    ones."""
    return _table(record, [n for n in record["figures"]["order"]
                           if not n.startswith(("alt_", "sweep_", "digits_"))])


def render_digits(record: dict[str, Any]) -> list[str]:
    """``digits``: the plain digits in a sentence: the untrained encoder, the range
    of the objectives and the ceiling (kNN, mean over the seeds)."""
    names = [n for n in record["figures"]["order"] if n.startswith("digits_")]
    knn = {n: statistics.fmean(found) for n in names if (found := values(record, n, "knn"))}
    floor, ceiling = knn.pop("digits_untrained", None), knn.pop("digits_cross_entropy", None)
    if floor is None or ceiling is None or not knn:
        return [source_line(record), "No plain-digit floor, objective and ceiling."]
    return [source_line(record), commits(record, names),
            f"kNN: untrained {floor:.3f}, the objectives {min(knn.values()):.3f} to "
            f"{max(knn.values()):.3f}, the cross-entropy ceiling {ceiling:.3f}."]


def over(shown: list[dict[str, Any]], figure: str) -> str:
    """``figure`` as mean ± sd over the shown runs that have it."""
    return mean_sd([f[figure] for f in shown if f[figure] is not None])


def render_gains(record: dict[str, Any]) -> list[str]:
    """``gains``: each alt-text configuration's kNN per seed, its gain over the untrained
    encoder of the same seed (kNN points), probe and zero-shot top-1."""
    runs = record["figures"]["runs"]
    floor = runs.get("untrained", {})
    names = [n for n in record["figures"]["order"] if n.startswith(("alt_", "sweep_alt_"))]
    lines = [source_line(record), commits(record, [*names, "untrained"]), "",
             "| configuration | seeds | kNN per seed | gain | linear probe | zero-shot top-1 |",
             "| --- | --- | --- | --- | --- | --- |"]
    for name in names:
        seeds = [s for s in sorted(runs[name], key=int) if s in floor]  # each beside its floor
        shown = [runs[name][s] for s in seeds]
        gain = [100 * (runs[name][s]["knn"] - floor[s]["knn"]) for s in seeds]
        per_seed = ", ".join(f"{figures['knn']:.3f}" for figures in shown)
        lines.append(f"| {name} | {', '.join(seeds)} | {per_seed} | "
                     f"{mean_sd(gain, 1, '+')} | {over(shown, 'probe')} | "
                     f"{over(shown, 'zero_shot')} |")
    return lines


def _shown(value: Any) -> str:
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def _given(value: Any) -> bool:
    """Whether a claim states ``value``: not None, nor NaN (a mean over no seed)."""
    return value is not None and value != "nan" and not (isinstance(value, float)
                                                         and math.isnan(value))


def claim_row(row: dict[str, Any]) -> str:
    """One row of a claim as a phrase: what it measured, against what, seed by seed."""
    said = []
    if "value" in row:
        against = f"{row['against']}'s " if "against" in row else ""
        said.append(f"{row['value']} against {against}{row['reference']}")
    if "knn" in row:
        said.append(f"kNN {_shown(row['knn'])}")
    if "gain" in row:
        said.append(f"{100 * row['gain']:+.1f} points"
                    + ("" if row.get("passed", True) else f", short of {100 * row['needed']:+.0f}"))
    if "ahead" in row:
        said.append(f"ahead at {row['ahead']}, by {row['lead']}")
    if "probe" in row:
        said.append(f"probe {row['probe']} against {row['probe_reference']}")
    said += [f"{key.replace('_', ' ')} {_shown(row[key])}" for key in CLAIM_FIGURES if key in row]
    label = row.get("objective", f"{row.get('num_negatives')} negatives")
    return f"{label} {', '.join(said)}"


CLAIM_FIGURES = ("class_mean_cosine", "image_to_text_r1", "zero_shot_top1")
CLAIM_TOTALS = ("untrained", "ceiling", "spearman_knn", "spearman_class_mean_cosine",
                "siglip_over_clip_gain", "beats_frozen_tower_clip")


def render_claims(record: dict[str, Any]) -> list[str]:
    """``claims``: each claim's verdict as the benchmark checked it, and the figures it
    checked (a claim missing a configuration names it instead)."""
    lines = []
    for c in record["figures"]["claims"]:
        if c.get("missing"):
            lines.append(f"- ({c['claim']}) {c['title']}: **not run** (no "
                         f"{', '.join(c['missing'])})")
            continue
        totals = [f"{key.replace('_', ' ')} {_shown(c[key])}" for key in CLAIM_TOTALS
                  if _given(c.get(key))]
        rows = "; ".join([*map(claim_row, c.get("rows", [])), *totals])
        lines.append(f"- ({c['claim']}) {c['title']}: **{verdict(c)}**"
                     + (f". {rows}." if rows else ""))
    return lines


VIEWS = {"main": render_main, "digits": render_digits, "gains": render_gains,
         "claims": render_claims}
