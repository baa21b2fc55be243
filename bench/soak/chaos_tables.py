"""The chaos soak's record (``soak/chaos``, written by ``python -m bench.soak.chaos
--record``) as the tables ``docs/benchmarks.md`` shows: each kind of fault, and what the
run kept through them."""

from __future__ import annotations

from typing import Any

from bench.records import source_line
from bench.soak.chaos_measure import KINDS, PAUSES

NAME, RENDERER = "soak/chaos", "bench.soak.chaos_tables"
FROZEN_TARGET_S = (60.0, 90.0)  # a frozen training process: median, max to the next step
LABELS = {"agent": "agent killed", "worker": "training process killed",
          "freeze": "training process frozen", "freeze_agent": "agent tree frozen",
          "straggler": "straggler"}


def seconds(value: float | None) -> str:
    return "" if value is None else f"{value:.1f} s"


def fault_row(kind: str, row: dict[str, Any], kills: list[dict[str, Any]]) -> str:
    label = LABELS[kind]
    pauses = [k["pause_s"] for k in kills if k["kind"] == kind and k["pause_s"] is not None]
    if pauses:
        label += f" ({', '.join(seconds(p) for p in pauses)})"
    timed = sum(1 for k in kills if k["kind"] == kind and k["recovery_s"] is not None)
    recovery = ("" if row["recovery_median_s"] is None else
                f"{seconds(row['recovery_median_s'])} ({seconds(row['recovery_max_s'])})"
                + (f", {timed} of {row['faults']} restarted the group" if timed < row["faults"]
                   else ""))
    restarts = str(row["restarts"]) if kind in PAUSES else ""
    return f"| {label} | {row['faults']} | {row['survived']} | {recovery} | {restarts} |"


def render_faults(record: dict[str, Any]) -> list[str]:
    got = record["figures"]
    summary, per_kind = got["summary"], got["summary"]["per_kind"]
    frozen = per_kind["freeze"]
    median, most = FROZEN_TARGET_S
    met = (frozen["recovery_median_s"] is not None and frozen["recovery_median_s"] <= median
           and frozen["recovery_max_s"] <= most)
    return [f"{source_line(record)} Seed {got['seed']}, {summary['kills']} faults over "
            f"{summary['epochs_asked']} epochs, {summary['soak_s'] / 60:.1f} min:", "",
            "| fault | faults | survived | to the next step, median (max) | restarts |",
            "|---|---|---|---|---|",
            *(fault_row(kind, per_kind[kind], got["kills"]) for kind in KINDS
              if per_kind.get(kind, {}).get("faults")),
            "", f"Target for a frozen process: {median:.0f} s median, {most:.0f} s max, "
            f"**{'met' if met else 'not met'}**."]


def render_measures(record: dict[str, Any]) -> list[str]:
    summary = record["figures"]["summary"]
    final = summary["final"]
    return ["| measure | soak |", "|---|---|",
            f"| epochs finished of those asked; the final checkpoint's global batch | "
            f"**{summary['epochs']} of {summary['epochs_asked']}; {final['global_batch']}** |",
            f"| samples trained twice / unread in an epoch, beyond its last partial batch | "
            f"**{summary['samples_twice']} / {summary['unread_beyond_last_batch']}** |",
            f"| steps trained again, all faults | {summary['steps_redone']} |",
            f"| loss, mean of the last 25 steps | {summary['final_loss']:.3f} (uninterrupted "
            f"{summary['uninterrupted_final_loss']:.3f}) |",
            f"| final weights, relative L2 distance to the uninterrupted 3-rank run's | "
            f"**{summary['weights_distance']:.3f}** |",
            f"| the same for the uninterrupted run on 1 rank (float32 sums alone) | "
            f"{summary['one_rank_weights_distance']:.3f} |"]


VIEWS = {"faults": render_faults, "measures": render_measures}
