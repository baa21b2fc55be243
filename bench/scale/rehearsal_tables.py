"""The rehearsal's record (``python -m bench.scale.rehearsal --record``, kept as
``scale/rehearsal``) as ``docs/benchmarks.md`` shows it: each stage's cost at the smallest
and largest size, its fitted exponents, the targets, and what the ledger found."""

from __future__ import annotations

from typing import Any

from bench.records import source_line
from bench.scale.scale_tables import fitted

STAGE_NAMES = {"make_shards": "make-shards", "graph": "graph-precompute",
               "pretrain": "pretrain", "ledger": "ledger tool", "evaluate": "evaluate"}
TIME_TARGET = 1.05  # the largest time exponent a stage may have
MEMORY_TARGET = 0.1  # the largest memory exponent of a stage's command or of its children


def cost(measures: dict[str, Any]) -> str:
    """Wall seconds and the peak resident memory of the stage's largest process."""
    seconds = measures["seconds"]
    shown = f"{seconds:.1f}" if seconds < 10 else f"{seconds:.0f}"
    return f"{shown} s, {max(measures['rss_mib'], measures['child_rss_mib']):,} MiB"


def memory_exponents(stage: str, record: dict[str, Any]) -> list[float]:
    """The command's memory exponent, and its children's where the stage has children."""
    figures = record["figures"]
    fit = figures["exponents"][stage]
    has_children = all(figures["results"][str(size)][stage]["child_rss_mib"] > 0
                       for size in figures["sizes"])
    return [fit["rss_mib"], *([fit["child_rss_mib"]] if has_children else [])]


def misses(stage: str, record: dict[str, Any]) -> list[str]:
    """Each exponent of ``stage`` above its target (a record keeps them to three places)."""
    fit = record["figures"]["exponents"][stage]
    labels = ("memory", "children's memory")  # the command's, then its children's if any
    exponents = {"time": fit["seconds"],
                 **dict(zip(labels, memory_exponents(stage, record), strict=False))}
    return [f"{STAGE_NAMES[stage]} {label} {value:.3f}" for label, value in exponents.items()
            if value > (TIME_TARGET if label == "time" else MEMORY_TARGET)]


def render_stages(record: dict[str, Any]) -> list[str]:
    """``stages``: a row per stage, the targets over every stage, the stages' time in all,
    and the ledger's count at the largest size."""
    figures = record["figures"]
    sizes = figures["sizes"]
    smallest, largest = figures["results"][str(sizes[0])], figures["results"][str(sizes[-1])]
    stages = [stage for stage in STAGE_NAMES if stage in figures["exponents"]]
    lines = [source_line(record), "",
             f"| stage | {sizes[0]:,} | {sizes[-1]:,} | time exponent | memory exponent "
             "(command, children) |", "| --- | --- | --- | --- | --- |"]
    for stage in stages:
        memory = ", ".join(fitted(e) for e in memory_exponents(stage, record))
        lines.append(f"| {STAGE_NAMES[stage]} | {cost(smallest[stage])} | "
                     f"{cost(largest[stage])} | {fitted(figures['exponents'][stage]['seconds'])}"
                     f" | {memory} |")
    missed = [miss for stage in stages for miss in misses(stage, record)]
    total = sum(figures["results"][str(size)][stage]["seconds"] for size in sizes
                for stage in stages)
    lines += ["", f"Targets: time exponents <= {TIME_TARGET} and memory flat (exponents <= "
                  f"{MEMORY_TARGET}) at every stage, "
                  f"{'**not met**: ' + ', '.join(missed) if missed else '**met**'}. The "
                  f"stages took {total / 60:.0f} min at the {len(sizes)} sizes together."]
    if "ledger" in largest:
        found = largest["ledger"]
        verdict = ("every sample read once but the epoch's last partial batch"
                   if found["exact"] else "**not** every sample read once")
        lines.append(f"At {sizes[-1]:,} the ledger found {found['more_than_once']:,} samples "
                     f"read twice and {found['unread']:,} unread (one global batch is "
                     f"{figures['global_batch']:,}): {verdict}.")
    return lines


VIEWS = {"stages": render_stages}
