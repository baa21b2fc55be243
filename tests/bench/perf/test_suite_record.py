"""The suite's record (bench/perf/suite.py) read off pytest's own summary lines."""

from __future__ import annotations

import subprocess
import sys

import pytest

from bench import records
from bench.perf import suite

PASSED = "= 2192 passed, 1 skipped, 6 warnings in 1898.31s (0:31:38) ="
FAILED = "= 77 failed, 336 passed, 1 skipped, 6 warnings, 269 errors in 3851.00s (1:04:10) ="


def test_the_last_summary_line_gives_the_counts_and_seconds():
    log = f"collected\n{'=' * 10} short test summary {'=' * 10}\n{PASSED}\n"
    assert suite.summary(log) == {"counts": {"passed": 2192, "skipped": 1, "warnings": 6},
                                  "seconds": 1898.31}
    with pytest.raises(ValueError, match="no pytest summary line"):
        suite.summary("collected 3 items\n...\n")


def test_only_a_passing_run_counts_as_one():
    assert suite.not_a_pass(suite.summary(PASSED)["counts"]) is None
    assert suite.not_a_pass(suite.summary(FAILED)["counts"]) == "{'failed': 77, 'errors': 269}"
    stopped = f"{'!' * 20} KeyboardInterrupt {'!' * 20}\n= 3 passed in 12.00s =\n"  # ctrl-c
    assert suite.not_a_pass(suite.summary(stopped)["counts"]) == "interrupted"
    assert suite.not_a_pass(suite.summary("= 4 skipped in 0.10s =")["counts"]) == \
        "nothing passed"


def test_a_log_of_a_failing_run_is_refused_and_writes_nothing(tmp_path):
    log = tmp_path / "suite.log"
    log.write_text(f"{FAILED}\n")
    kept = records.RECORDS / f"{suite.NAME}.json"
    before = kept.read_bytes() if kept.exists() else None
    done = subprocess.run([sys.executable, "-m", "bench.perf.suite", str(log)],
                          cwd=records.REPO, capture_output=True, text=True)
    assert done.returncode != 0
    assert f"{log}: the run did not pass ({{'failed': 77, 'errors': 269}})" in done.stderr
    assert (kept.read_bytes() if kept.exists() else None) == before


def test_the_summary_view_states_minutes_seconds_and_passed(tmp_path, monkeypatch):
    monkeypatch.setattr(records, "RECORDS", tmp_path / "records")
    records.write_record("perf/scratch", records.provenance(["python", "-m", "x"]),
                         suite.RENDERER,
                         suite.summary(PASSED))
    line = records.rendered("perf/scratch", "summary")
    assert "**31 min 38 s** of pytest on two xdist workers, 2,192 passed." in line
