"""The peaks record (``python -m bench.perf.negatives --part peaks --record``) shows what each
objective adds to its idle process at each tile size, against its budget."""

from __future__ import annotations

from bench.perf.negatives_tables import render_peaks
from bench.records import provenance


def peaks(added: dict[tuple[str, int], float]) -> dict:
    budget = {256: 0.25, 4096: 0.26}
    rows = [{"objective": o, "tile_size": t, "above_idle_gib": a,
             "recorded_above_idle_gib": budget[t]} for (o, t), a in added.items()]
    return {**provenance(["python", "-m", "bench.perf.negatives"]), "figures": {"rows": rows}}


def test_each_objective_shows_its_tiles_in_order_and_the_target_over_all_rows():
    within = {("infonce", 256): 0.27, ("infonce", 4096): 0.28, ("xclr", 256): 0.25,
              ("xclr", 4096): 0.31}  # 0.31 <= 1.2 x 0.26
    (line,) = render_peaks(peaks(within))
    assert line.endswith(
        " At N = 131,072, each in a fresh process, GiB above the idle process at T = 256 / "
        "4,096: infonce 0.27 / 0.28, xclr 0.25 / 0.31; target, each at most 1.2x its budget "
        "(infonce 0.25 / 0.26, xclr 0.25 / 0.26): **met**.")
    over = {**within, ("xclr", 4096): 0.32}  # above 1.2 x 0.26 = 0.312
    assert render_peaks(peaks(over))[0].endswith("**not met**.")
