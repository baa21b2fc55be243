"""Figures in the docs equal their records: every block a page cites is its record's
rendering, every commit a record names is an ancestor of HEAD, and a table of means ± sd
outside a cited block sits in a section that says no record holds it."""

from __future__ import annotations

import ast
import datetime
import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import records
from bench.common import write_json
from bench.learning import xclr_record


def test_every_cited_block_in_the_docs_equals_its_record():
    assert sum(len(records.citations(page)) for page in records.pages()) >= 1
    assert records.mismatches(records.pages()) == []


def test_no_page_shows_a_mean_and_deviation_that_no_record_backs():
    assert [line for page in records.pages() for line in records.hand_statistics(page)] == []


def test_a_table_of_results_copied_by_hand_is_found(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Results\n\n| run | kNN |\n| --- | --- |\n| a | 0.5 ± 0.1 |\n\n"
                    "## Recorded\n\n<!-- record: x/y table -->\n| b | 0.4 ± 0.1 |\n"
                    "<!-- /record -->\n\n## Old\n\nNo record\nholds this table:\n\n"
                    "| c | 0.3 ± 0.1 |\n\n| c2 | 0.3+/-0.1 |\n\n## Mixed\n\nNo record holds "
                    "the next.\n\nBut this one:\n\n| d | 0.2±0.1 |\n\n```bash\n# not a "
                    "heading\n```\n\n| e | 0.1 +/- 0.1 |\n")
    assert records.hand_statistics(page) == ["page.md, # Results: | a | 0.5 ± 0.1 |",
                                             "page.md, ## Mixed: | d | 0.2±0.1 |",
                                             "page.md, ## Mixed: | e | 0.1 +/- 0.1 |"]


def test_every_record_kept_is_cited_by_a_page():
    cited = {c.name for page in records.pages() for c in records.citations(page)}
    assert set(records.records()) - cited == set()


@pytest.mark.parametrize("name", records.records() or ["(none kept)"])
def test_every_commit_a_record_names_is_an_ancestor_of_head(name):
    if name == "(none kept)":
        pytest.skip("no record kept")
    record = records.read_record(name)
    assert record["dirty"] is False, f"{name}: made from a tree that differed from its commit"
    for commit in records.commits(record):
        assert records.git("cat-file", "-e", f"{commit}^{{commit}}") is not None, (
            f"{name}: commit {commit} is not in this repository")
        assert records.git("merge-base", "--is-ancestor", commit, "HEAD") is not None, (
            f"{name}: commit {commit} is not an ancestor of HEAD")


def lever_record(tmp_path, monkeypatch) -> str:
    """A record of two seeds of the recipe kept in a scratch records folder."""
    monkeypatch.setattr(records, "RECORDS", tmp_path / "records")
    runs = {"sweep_alt_xclr_tau_s0.05_centred": {
        "0": {"knn": 0.5, "floor": 0.1, "probe": 0.6, "commit": None},
        "1": {"knn": 0.4, "floor": 0.2, "probe": 0.5, "commit": None}}}
    records.write_record("learning/scratch", records.provenance(["python", "-m", "x"]),
                         xclr_record.RENDERER, {"runs": runs})
    return "learning/scratch"


def test_the_lever_view_is_the_mean_and_sample_deviation_of_each_seed(tmp_path, monkeypatch):
    name = lever_record(tmp_path, monkeypatch)
    # gains 40 and 20 points: mean 30, sample deviation 20 / sqrt(2) = 14.14
    assert records.rendered(name, "levers").splitlines()[2] == (
        "| tau_s 0.05, centred store | 0, 1 | 0.500, 0.400 | +30.0 ± 14.1 | "
        "0.550 ± 0.071 |")
    kept = json.loads((tmp_path / "records" / f"{name}.json").read_text())
    assert {"command", "commit", "date", "machine"} <= set(kept)


def test_a_figure_in_prose_is_found_unless_a_record_it_names_shows_it(tmp_path, monkeypatch):
    name = lever_record(tmp_path, monkeypatch)  # its view shows +30.0 ± 14.1, 0.550 ± 0.071
    page = tmp_path / "page.md"
    page.write_text(f"# A\n\nThe gain was +30.0 ± 14.1 (`{name}`), the probe 0.550 +/- 0.071."
                    f"\n\nPlanted: +31.0 ± 14.1 (`{name}`).\n\nUnnamed: 0.4 ± 0.1, 0.123.\n\n"
                    f"Per seed 0.500 and 0.400, tau 0.05; planted 0.501 (`{name}`).\n\n"
                    "Old runs: 0.3 ± 0.1; no record\nholds them.\n\n## B\n\nNo record holds "
                    "the list:\n\n- x 0.2 ± 0.1\n\nThis one:\n\n- y 0.1 ± 0.1\n- z, "
                    f"`{name}`: 0.550 ± 0.071\n\nAs `{name}` shows:\n\n- w 0.550 ± 0.071\n\n"
                    f"## C\n\nAt a sentence's end 0.777. Cut short +30.0 ± 14, no space "
                    f"+30.0±14.1, a lost sign -0.500 (`{name}`).\n\nA key `x=0.123 ± 0.1`.\n\n"
                    "Misspelt: 0.550 ± 0.071 (`learning/scratchh`).\n")
    assert records.hand_statistics(page) == [
        f"page.md, # A: +31.0 ± 14.1 (not in {name})",
        "page.md, # A: 0.4 ± 0.1 (no record named)",
        f"page.md, # A: 0.501 (not in {name})",
        "page.md, ## B: 0.1 ± 0.1 (no record named)",
        f"page.md, ## C: +30.0 ± 14 (not in {name})",
        f"page.md, ## C: 0.777 (not in {name})",
        f"page.md, ## C: -0.500 (not in {name})",
        "page.md, ## C: names learning/scratchh, which is not kept"]


def test_a_figure_changed_by_hand_is_found(tmp_path, monkeypatch):
    name = lever_record(tmp_path, monkeypatch)
    page = tmp_path / "page.md"
    page.write_text(f"Intro.\n\n<!-- record: {name} levers -->\nold\n<!-- /record -->\n")
    records.write_citations([page])
    assert records.mismatches([page]) == []
    planted = page.read_text().replace("+30.0", "+31.0")
    page.write_text(planted)
    assert records.mismatches([page]) == [
        f"{page}:3: the block shows {name} levers otherwise than its record (write it from "
        "the record: python -m bench.records --write)"]


def test_a_marker_the_pattern_cannot_read_is_named(tmp_path, monkeypatch):
    name = lever_record(tmp_path, monkeypatch)
    page = tmp_path / "page.md"
    page.write_text(f"<!-- record: {name} levers --> \nold\n<!-- /record -->\n")
    assert records.mismatches([page]) == ["page.md:1: a record marker not read",
                                          "page.md:3: a record marker not read"]


def test_a_block_citing_a_record_not_kept_is_named_and_left_as_it_is(tmp_path, monkeypatch):
    monkeypatch.setattr(records, "RECORDS", tmp_path / "records")
    page = tmp_path / "page.md"
    text = "<!-- record: perf/gone table -->\nold\n<!-- /record -->\n"
    page.write_text(text)
    records.write_citations([page])
    assert page.read_text() == text
    assert records.mismatches([page]) == [
        f"{page}:1: cites perf/gone, which is not kept (bench/records/perf/gone.json)"]


def test_a_view_its_renderer_does_not_have_is_named_with_those_it_has(tmp_path, monkeypatch):
    name = lever_record(tmp_path, monkeypatch)
    with pytest.raises(ValueError, match=r"learning/scratch: no view 'table' \(levers\)"):
        records.rendered(name, "table")


def test_a_record_keeps_the_provenance_its_run_started_from(tmp_path, monkeypatch):
    monkeypatch.setattr(records, "RECORDS", tmp_path / "records")
    started = {**records.provenance(["python", "-m", "x"]), "commit": "a" * 40, "dirty": False}
    path = records.write_record("perf/scratch", started, xclr_record.RENDERER, {"runs": {}})
    kept = json.loads(path.read_text())
    assert {k: kept[k] for k in started} == started  # not the tree as it is when it ends


def test_a_commit_outside_the_history_is_named(tmp_path, monkeypatch):
    record = {"commit": "0" * 40, "figures": {"runs": [{"0": {"commit": "1" * 40}}]}}
    assert records.commits(record) == {"0" * 40, "1" * 40}
    assert records.git("merge-base", "--is-ancestor", "0" * 40, "HEAD") is None


def test_a_benchmark_result_names_its_command_commit_date_and_machine(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", [str(records.REPO / "bench/perf/views.py"), "--rounds",
                                      "3"])
    today = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
    write_json(tmp_path / "result.json", {"ms": 1.5})
    dates = {today, datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")}  # at midnight
    result = json.loads((tmp_path / "result.json").read_text())
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=records.REPO, capture_output=True,
                          text=True, check=True).stdout.strip()
    seen = result["provenance"]
    assert result["ms"] == 1.5
    assert seen["command"] == "python -m bench.perf.views --rounds 3"
    assert seen["commit"] == head
    assert seen["dirty"] is bool(subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"], cwd=records.REPO,
        capture_output=True, text=True, check=True).stdout.strip())
    assert seen["date"] in dates
    assert seen["machine"]["cpu"] and seen["machine"]["torch"]


def _json_written_past_the_writers(path: Path) -> list[int]:
    """Lines of ``path`` that write ``json.dumps`` output to a file themselves
    (``x.write_text(json.dumps(...))``, ``json.dump(obj, file)``) instead of through
    ``write_json`` or ``write_record``, which add the provenance (the GPU kit's report adds
    its own: ``tests/bench/gpu/test_gpu_kit.py``)."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call):
            continue
        name = ast.unparse(node.func)
        if "_stats.json" in name:  # a shard's statistics, data a rehearsal reads, no result
            continue
        if name == "json.dump" or (name.endswith(".write_text") and any(
                isinstance(arg, ast.Call) and ast.unparse(arg.func) == "json.dumps"
                for arg in node.args)):
            lines.append(node.lineno)
    return lines


def test_every_benchmark_writes_its_results_through_a_writer_that_adds_the_provenance():
    own = {records.REPO / "bench" / "common.py", records.REPO / "bench" / "records.py"}
    found = {str(path.relative_to(records.REPO)): lines
             for path in sorted((records.REPO / "bench").rglob("*.py")) if path not in own
             for lines in [_json_written_past_the_writers(path)] if lines}
    assert found == {}, f"JSON written past write_json and write_record: {found}"


def test_a_tree_is_changed_by_its_sources_not_by_the_results_it_keeps(tmp_path):
    """Runs write records and kept learning runs into the checkout they measure: those do
    not make the next run's tree "dirty"; a changed source does."""
    def run(*args: str) -> None:
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    files = ["src.py", *(f"{path}/a.json" for path in records.KEPT_OUTPUTS)]
    for name in files:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("1\n")
    run("init", "-q")
    run("add", ".")
    run("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c")
    for name in files[1:]:
        (tmp_path / name).write_text("2\n")
    assert records.provenance(["python"], cwd=tmp_path)["dirty"] is False
    (tmp_path / "src.py").write_text("2\n")
    assert records.provenance(["python"], cwd=tmp_path)["dirty"] is True
