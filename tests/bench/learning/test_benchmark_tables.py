"""The learning benchmark's record (``bench/learning/benchmark_tables.py``) keeps each
finished run's figures and provenance, and its views show them as the page does."""

from __future__ import annotations

import json
import subprocess
import sys

from bench.learning import benchmark_tables, runs
from bench.learning.claims import check
from bench.records import REPO, git, provenance


def result(seed: int, knn: float, probe: float, commit: str | None = None,
           captions: bool = False) -> dict:
    geometry = {"margin": 0.01, "class_mean_cosine": -0.05 + seed / 100,
                "intra_class_variance": 0.5}
    evaluation = {"knn": {"backbone": {"k20": {"top1": knn}},
                          "projector": {"k20": {"top1": knn + 0.01}}},
                  "linear_probe": {"top1": probe},
                  "diagnostics": {"backbone": geometry, "projector": geometry},
                  "similarity": {"backbone": {"rank_correlation_caption_graph": 0.1}}}
    if captions:
        evaluation["retrieval"] = {"image_to_text": {"R@1": 0.3}}
        evaluation["zero_shot"] = {"accuracy": {"top1": 0.6 + seed / 10}}
    seen = {"commit": commit, "date": "2026-12-07", "machine": {"cpu": "AMD EPYC"}} \
        if commit else None
    return {"configuration": {"seed": seed}, "evaluation": evaluation,
            **({"provenance": seen} if seen else {})}


def record_of(results: dict, claims: list | None = None) -> dict:
    figures = benchmark_tables.figures(results, claims or [])
    return {**provenance(["python", "-m", "bench.learning", "--record"]),  # as the file holds it
            "figures": json.loads(json.dumps(figures, sort_keys=True))}


def test_the_main_view_shows_mean_and_sd_over_the_seeds_and_where_the_runs_ran():
    # in the order the benchmark ran them, though the record file sorts its keys
    results = {"untrained": [result(0, 0.15, 0.17, "a" * 40), result(1, 0.17, 0.19, "a" * 40)],
               "supcon": [result(0, 0.66, 0.70, "b" * 40), result(1, 0.70, 0.72)],
               "projnce_learned": [{"configuration": {"seed": 0}, "evaluation": {
                   "knn": {"backbone": {"k20": {"top1": 0.74}}}, "linear_probe": {"top1": 0.76}}}],
               "supcon_k1": [{"configuration": {"seed": 0}, "training": {"stopped": "x"}}],
               "alt_clip": [result(0, 0.6, 0.7, captions=True)]}
    lines = benchmark_tables.render_main(record_of(results))
    assert lines[1] == "5 runs; at aaaaaaa, bbbbbbb, 2026-12-07; 2 without a recorded commit."
    assert lines[5:] == [
        "| untrained | 2 | 0.160 ± 0.014 | 0.170 ± 0.014 | 0.180 ± 0.014 | -0.045 | 0.500 |",
        "| supcon | 2 | 0.680 ± 0.028 | 0.690 ± 0.028 | 0.710 ± 0.014 | -0.045 | 0.500 |",
        "| projnce_learned | 1 | 0.740 |  | 0.760 |  |  |"]


def test_the_digits_view_gives_the_floor_the_objectives_range_and_the_ceiling():
    results = {"untrained": [result(0, 0.15, 0.17)], "digits_untrained": [result(0, 0.93, 0.9)],
               "digits_supcon": [result(0, 0.98, 0.97), result(1, 0.99, 0.98)],
               "digits_infonce": [result(0, 0.97, 0.97)],
               "digits_cross_entropy": [result(0, 0.994, 0.99)]}
    record = record_of(results)
    assert benchmark_tables.render_digits(record)[2] == (
        "kNN: untrained 0.930, the objectives 0.970 to 0.985, the cross-entropy ceiling 0.994.")
    assert [line.split(" |")[0] for line in benchmark_tables.render_main(record)[5:]] == [
        "| untrained"]
    without = record_of({"untrained": [result(0, 0.15, 0.17)]})
    assert benchmark_tables.render_digits(without)[1] == (
        "No plain-digit floor, objective and ceiling.")


def test_the_gains_view_measures_each_seed_against_its_own_untrained_encoder():
    # seeds in numeric order (2 before 10); seed 3 has no floor, so none of its figures show
    results = {"untrained": [result(10, 0.16, 0.1), result(2, 0.14, 0.1)],
               "alt_clip": [result(10, 0.55, 0.72, captions=True),
                            result(3, 0.90, 0.99, captions=True),
                            result(2, 0.64, 0.74, captions=True)],
               "sweep_alt_xclr_tau_s0.05": [result(2, 0.52, 0.56)]}
    lines = benchmark_tables.render_gains(record_of(results))
    assert lines[1] == "6 runs; 6 without a recorded commit."  # the floors' runs counted
    assert lines[5:] == [
        "| alt_clip | 2, 10 | 0.640, 0.550 | +44.5 ± 7.8 | 0.730 ± 0.014 | 1.200 ± 0.566 |",
        "| sweep_alt_xclr_tau_s0.05 | 2 | 0.520 | +38.0 | 0.560 |  |"]


def test_the_claims_view_gives_each_verdict():
    claims = [{"claim": "a", "title": "t", "reproduced": True},
              {"claim": "b", "title": "u", "reproduced": None, "missing": ["x", "y"]},
              {"claim": "c", "title": "v", "reproduced": False},
              {"claim": "i", "title": "w", "reproduced": False,  # a ratio over no gain
               "siglip_over_clip_gain": float("nan"), "untrained": 0.15}]
    assert benchmark_tables.render_claims(record_of({}, claims)) == [
        "- (a) t: **reproduces**", "- (b) u: **not run** (no x, y)",
        "- (c) v: **does not reproduce**", "- (i) w: **does not reproduce**. untrained 0.150."]


def test_the_claims_view_shows_the_figures_each_claim_checked_seed_by_seed():
    """Claim (h) from per-seed results: the lead is taken at each seed both finished (seed
    2 of projnce_learned has no supcon beside it), not from the means."""
    results = {"supcon": [result(0, 0.60, 0.70), result(1, 0.70, 0.72)],
               "projnce_learned": [result(0, 0.65, 0.74), result(1, 0.68, 0.75),
                                   result(2, 0.99, 0.99)]}
    (line,) = [c for c in benchmark_tables.render_claims(record_of(results, check(results)))
               if c.startswith("- (h)")]
    assert line.endswith(": **reproduces**. projnce_learned 0.773 ± 0.188 against supcon's "
                         "0.650 ± 0.071, ahead at 1 of 2 seeds, by -2.0 to +5.0 points, "
                         "probe 0.827 ± 0.142 against 0.710 ± 0.014.")
    (negatives,) = [c for c in benchmark_tables.render_claims(record_of(results, check(results)))
                    if c.startswith("- (e)")]
    assert negatives.endswith("**not run** (no supcon_k1, supcon_k4, supcon_k16, supcon_k64)")


def test_a_smoke_run_is_not_recorded():
    done = subprocess.run([sys.executable, "-m", "bench.learning", "--record", "--set",
                           "train.max_steps=5"], cwd=REPO, capture_output=True, text=True,
                          check=False)
    assert done.returncode == 2
    assert "--record keeps the recipes' runs: leave out --set" in done.stderr


def test_a_run_made_now_hands_back_the_provenance_its_file_keeps(tmp_path, monkeypatch):
    """A run trained by the same command that records carries its commit, as one read
    back from its folder in a later session does."""
    monkeypatch.setattr(runs, "run_config", lambda conf, data, root: (None, []))
    monkeypatch.setattr(runs, "untrained", lambda conf, data, root: object())
    monkeypatch.setattr(runs, "evaluate", lambda model, config, data, out: {"knn": 0.5})
    conf = runs.Configuration("untrained-s0", "infonce.yaml", "cluttered", seed=0)
    made = runs.run(conf, None, tmp_path, floor=True)
    assert made["provenance"]["commit"] == git("rev-parse", "HEAD")
    assert benchmark_tables.run_figures(made)["commit"] == made["provenance"]["commit"]
    assert runs.run(conf, None, tmp_path, floor=True) == made  # read back from its file


def test_a_claim_says_what_fell_short_in_its_own_units_and_no_nan():
    """Claim (a) names the margin a row missed; claim (c) compares a cosine margin, not an
    accuracy, so its per-seed lead is in cosine; claim (a) without a ceiling states none."""
    results = {"untrained": [result(0, 0.15, 0.17), result(1, 0.15, 0.17)],
               "supcon": [result(0, 0.60, 0.70), result(1, 0.70, 0.72)],
               "sincere": [result(0, 0.62, 0.70), result(1, 0.72, 0.72)],
               "infonce": [result(0, 0.25, 0.3), result(1, 0.35, 0.3)]}
    for name, margins in (("supcon", (0.010, 0.030)), ("sincere", (0.015, 0.028))):
        for found, margin in zip(results[name], margins, strict=True):
            found["evaluation"]["diagnostics"]["projector"] = {
                **found["evaluation"]["diagnostics"]["projector"], "margin": margin}
    lines = {line[3]: line for line in
             benchmark_tables.render_claims(record_of(results, check(results, ("main",))))}
    assert lines["c"].endswith("**reproduces**. sincere 0.021 ± 0.009 against supcon's "
                               "0.020 ± 0.014, ahead at 1 of 2 seeds, by -0.002 to +0.005.")
    a = {**results, **{name: results["supcon"] for name in
                       ("flatnce", "holder_flatnce", "xclr_class_graph", "projnce_centroid")}}
    a["infonce"] = [result(0, 0.28, 0.3), result(1, 0.28, 0.3)]  # +13 points: short of +15
    (line,) = [c for c in benchmark_tables.render_claims(record_of(a, check(a, ("main",))))
               if c.startswith("- (a)")]
    assert "infonce kNN 0.280 ± 0.000, +13.0 points, short of +15; flatnce" in line
    assert line.endswith("+50.0 points; untrained 0.150.")  # no ceiling ran: none stated


def test_a_part_checks_its_own_claims():
    """A record of one part says nothing of the other part's claims (not even "not run")."""
    assert [c["claim"] for c in check({}, ("main",))] == list("abcdefgh")
    assert [c["claim"] for c in check({}, ("alt_text",))] == ["i", "j"]
    assert [c["claim"] for c in check({}, ("sweep",))] == []
