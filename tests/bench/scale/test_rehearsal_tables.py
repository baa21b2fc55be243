"""The rehearsal's record (``bench/scale/rehearsal_tables.py``) shows what a run of
``python -m bench.scale.rehearsal --record`` measured, fitted as ``bench.scale.fit`` fits
it, and a record holds one run."""

from __future__ import annotations

import json
import subprocess
import sys

from bench.records import REPO, provenance
from bench.scale import rehearsal, rehearsal_tables


def stage(seconds: float, rss: int, child_rss: int = 0) -> dict[str, float]:
    return {"seconds": seconds, "rss_mib": rss, "child_rss_mib": child_rss, "anon_mib": rss // 2,
            "child_anon_mib": child_rss // 2, "disk_mib": 1.0, "knn": "kNN top-1 0.1"}


def measured_run() -> dict[int, dict[str, dict[str, float]]]:
    """Two sizes 8x apart: make-shards linear and flat; pretrain's children grow (2x over
    8x: exponent 1/3); the ledger sub-linear, one sample read twice at the largest size."""
    def ledger(seconds: float, twice: int, unread: int) -> dict[str, float]:
        return {**stage(seconds, 700), "more_than_once": twice, "unread": unread,
                "once": 0, "exact": twice == 0}

    return {125_000: {"make_shards": stage(33.0, 718), "pretrain": stage(116.0, 900, 600),
                      "ledger": ledger(4.3, 0, 100)},
            1_000_000: {"make_shards": stage(264.0, 718), "pretrain": stage(928.0, 900, 1200),
                        "ledger": ledger(8.6, 1, 576)}}


def test_each_stage_shows_its_cost_exponents_and_the_targets_and_ledger_verdict():
    results = measured_run()
    figures = rehearsal.figures(results, rehearsal.fitted(results))
    record = {**provenance(["python", "-m", "bench.scale.rehearsal", "--record"]),
              "figures": json.loads(json.dumps(figures))}  # as the record file holds them
    lines = rehearsal_tables.render_stages(record)
    assert lines[2:] == [
        "| stage | 125,000 | 1,000,000 | time exponent | memory exponent (command, children) |",
        "| --- | --- | --- | --- | --- |",
        "| make-shards | 33 s, 718 MiB | 264 s, 718 MiB | 1.00 | 0.00 |",
        "| pretrain | 116 s, 900 MiB | 928 s, 1,200 MiB | 1.00 | 0.00, 0.33 |",
        "| ledger tool | 4.3 s, 700 MiB | 8.6 s, 700 MiB | 0.33 | 0.00 |",
        "",
        # 33 + 116 + 4.3 + 264 + 928 + 8.6 = 1,353.9 s
        "Targets: time exponents <= 1.05 and memory flat (exponents <= 0.1) at every stage, "
        "**not met**: pretrain children's memory 0.333. The stages took 23 min at the 2 "
        "sizes together.",
        "At 1,000,000 the ledger found 1 samples read twice and 576 unread (one global batch "
        "is 2,048): **not** every sample read once."]


def test_a_record_is_one_run_so_record_refuses_merge():
    done = subprocess.run([sys.executable, "-m", "bench.scale.rehearsal", "--record", "--merge"],
                          cwd=REPO, capture_output=True, text=True, check=False)
    assert done.returncode == 2
    assert "--record keeps one run's figures: leave out --merge" in done.stderr


def test_a_flat_linear_run_meets_the_targets_and_its_ledger_reads_every_sample_once():
    results = measured_run()
    results[1_000_000]["pretrain"]["child_rss_mib"] = 600  # flat children
    results[1_000_000]["ledger"].update(more_than_once=0, exact=True)
    figures = rehearsal.figures(results, rehearsal.fitted(results))
    lines = rehearsal_tables.render_stages(
        {**provenance(["python"]), "figures": json.loads(json.dumps(figures))})
    assert lines[-2:] == [
        "Targets: time exponents <= 1.05 and memory flat (exponents <= 0.1) at every stage, "
        "**met**. The stages took 23 min at the 2 sizes together.",
        "At 1,000,000 the ledger found 0 samples read twice and 576 unread (one global batch "
        "is 2,048): every sample read once but the epoch's last partial batch."]


def test_a_record_needs_two_distinct_sizes():
    done = subprocess.run([sys.executable, "-m", "bench.scale.rehearsal", "--record",
                           "--sizes", "1000", "1000"], cwd=REPO, capture_output=True,
                          text=True, check=False)
    assert done.returncode == 2 and "give at least two --sizes" in done.stderr


def test_each_miss_is_named_time_included_at_the_places_it_is_shown():
    """make-shards 10x slower over 8x the data (exponent 1.107), the ledger's memory 700 ->
    862 MiB (exponent 0.1001, shown 0.100: not a miss)."""
    results = measured_run()
    results[1_000_000]["make_shards"]["seconds"] = 330.0
    results[1_000_000]["ledger"]["rss_mib"] = 862
    results[1_000_000]["pretrain"]["child_rss_mib"] = 600
    figures = rehearsal.figures(results, rehearsal.fitted(results))
    lines = rehearsal_tables.render_stages(
        {**provenance(["python"]), "figures": json.loads(json.dumps(figures))})
    assert lines[-2].startswith(
        "Targets: time exponents <= 1.05 and memory flat (exponents <= 0.1) at every stage, "
        "**not met**: make-shards time 1.107. The stages took")
