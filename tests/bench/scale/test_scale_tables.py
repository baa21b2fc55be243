"""The scale records' views (``bench/scale/scale_tables.py``) show the figures a run of
``python -m bench.scale`` kept, fitted as ``bench.scale.fit`` fits them."""

from __future__ import annotations

from bench.records import provenance
from bench.scale import scale_tables
from bench.scale.fit import exponent


def test_the_evaluation_view_shows_each_stage_in_order_with_its_fitted_exponents():
    sizes = [128_000, 1_281_167]
    seconds = {"knn": [40.0, 400.0], "margin": [60.0, 620.0], "probe": [4.0, 36.0],
               "diagnostics": [6.0, 5.0]}
    added = {"knn": [900, 900], "margin": [200, 250], "probe": [500, 500],
             "diagnostics": [400, 600]}
    rows = [{"stage": stage, "rows": n, "seconds": s, "stage_added_mib": m}
            for stage, times in seconds.items()
            for n, s, m in zip(sizes, times, added[stage], strict=True)]
    # log(cost ratio) / log(10.009): time 1.00, 1.01, 0.95, -0.08; memory 0, 0.097, 0, 0.176
    fit = {stage: {"seconds": exponent(sizes, times),
                   "stage_added_mib": exponent(sizes, added[stage])}
           for stage, times in seconds.items()}
    # a record's JSON keeps its keys sorted: the view orders the stages itself
    part = {"rows": rows, "exponent": dict(sorted(fit.items()))}
    record = {**provenance(["python", "-m", "bench.scale"]), "figures": {"evaluation": part}}
    lines = scale_tables.render_evaluation(record)
    assert lines[2] == ("| stage | bank 128,000 | 1,281,167 | time exponent | added memory, "
                        "smallest / largest | memory exponent |")
    assert lines[4:] == [
        "| kNN (faiss flat, k <= 200) | 40.0 s | 400.0 s | 1.00 | 900 MiB / 900 MiB | 0.00 |",
        "| SINCERE margin | 60.0 s | 620.0 s | 1.01 | 200 MiB / 250 MiB | 0.10 |",
        "| linear probe, 1 epoch | 4.0 s | 36.0 s | 0.95 | 500 MiB / 500 MiB | 0.00 |",
        "| diagnostics (on 10,000 queries) | 6.0 s | 5.0 s | -0.08 | 400 MiB / 600 MiB | 0.18 |"]


def test_sizes_read_as_a_person_writes_them():
    assert [scale_tables.count(n) for n in (130_000, 1_000_000, 1_281_167, 4, 2_000)] == [
        "130k", "1M", "1.28M", "4", "2k"]
