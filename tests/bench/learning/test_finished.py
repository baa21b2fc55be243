"""The learning benchmark's kept runs (``bench/learning/finished.py``): a run kept in the
repository is restored only for the configuration that made it and a recipe unchanged
since, only a clean commit's run of the table's configuration is kept, and every kept run
matches today's table and names an ancestor of HEAD."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys

import pytest

from bench.learning import configs, finished, runs
from bench.learning.__main__ import run_all
from bench.records import REPO, git

TABLE = {conf.name: conf for conf in configs.every(list(range(5)))}
HEAD = git("rev-parse", "HEAD")
KEPT = sorted(p.stem for p in finished.FINISHED.glob("*.json")) if finished.FINISHED.is_dir() \
    else []


def made(conf: runs.Configuration, commit: str | None = HEAD, dirty: bool = False,
         knn: float = 0.5) -> dict:
    return json.loads(json.dumps({"configuration": dataclasses.asdict(conf),
                                  "evaluation": {"knn": knn},
                                  "provenance": {"commit": commit, "dirty": dirty}}))


def write(path, payload) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload))


def test_a_kept_run_is_restored_for_its_own_configuration(tmp_path):
    conf = TABLE["supcon-s1"]
    write(tmp_path / "kept" / "supcon-s1.json", made(conf))
    assert finished.restore(conf, tmp_path / "out", tmp_path / "kept")
    assert json.loads(finished.result_path(conf, tmp_path / "out").read_text()) == made(conf)
    assert not finished.restore(conf, tmp_path / "out", tmp_path / "kept")  # one is there


def test_a_kept_run_of_another_configuration_is_trained_again(tmp_path, capsys):
    conf = TABLE["supcon-s1"]
    changed = dataclasses.replace(conf, overrides=("objective.temperature=0.1",))
    write(tmp_path / "kept" / "supcon-s1.json", made(changed))
    assert not finished.restore(conf, tmp_path / "out", tmp_path / "kept")
    assert not finished.result_path(conf, tmp_path / "out").exists()
    assert capsys.readouterr().out == (
        f"{tmp_path / 'kept' / 'supcon-s1'}.json: kept for another configuration than the "
        "table's supcon-s1; trained again\n")


def history(tmp_path, monkeypatch, *edits) -> tuple[runs.Configuration, list[str]]:
    """A checkout of its own holding supcon-s1's recipe and the data code as read here,
    committed, then committed again after each edit ``(path, old, new)`` (``new`` None:
    the file removed); :mod:`finished` reads it. The commits, oldest first."""
    conf, repo = TABLE["supcon-s1"], tmp_path / "repo"
    for path in (conf.recipe, *finished.DATA_SOURCES):
        (repo / path).parent.mkdir(parents=True, exist_ok=True)
        (repo / path).write_text((REPO / path).read_text())
    def run_git(*args: str) -> str:
        out = git("-c", "user.email=t@t", "-c", "user.name=t", "-c", "commit.gpgsign=false",
                  *args, cwd=repo)
        assert out is not None, args
        return out
    run_git("init", "-q")
    commits = []
    for path, old, new in [(conf.recipe, "", ""), *edits]:
        file = repo / path
        if new is None:
            file.unlink()
        else:
            assert old in file.read_text()
            file.write_text(file.read_text().replace(old, new, 1))
        run_git("add", "-A")
        run_git("commit", "-q", "--allow-empty", "-m", "edit")
        commits.append(run_git("rev-parse", "HEAD"))
    monkeypatch.setattr(finished, "REPO", repo)
    return conf, commits


def restored_after(tmp_path, monkeypatch, *edits) -> bool:
    """Whether a run kept at the first commit of :func:`history` is restored after it."""
    conf, commits = history(tmp_path, monkeypatch, *edits)
    write(tmp_path / "kept" / "supcon-s1.json", made(conf, commits[0]))
    return finished.restore(conf, tmp_path / "out", tmp_path / "kept")


def test_a_kept_run_whose_recipe_changed_since_is_trained_again(tmp_path, monkeypatch, capsys):
    conf = TABLE["supcon-s1"]
    assert not restored_after(tmp_path, monkeypatch, (conf.recipe, "temperature: 0.2",
                                                      "temperature: 0.3"))
    before = git("rev-list", "--max-parents=0", "HEAD", cwd=tmp_path / "repo")
    assert capsys.readouterr().out == (
        f"{tmp_path / 'kept' / 'supcon-s1'}.json: its recipe or data code changed since "
        f"{before[:7]}; trained again\n")


@pytest.mark.parametrize("edit", [
    ("temperature: 0.2", "temperature: 0.20"),  # a value written otherwise: as a change
    ("#", "# (reworded)"),  # a comment alone: not a change
], ids=["value written otherwise", "comment"])
def test_a_kept_run_is_restored_only_while_its_recipe_holds_its_values(tmp_path, monkeypatch,
                                                                       edit):
    conf = TABLE["supcon-s1"]
    assert restored_after(tmp_path, monkeypatch, (conf.recipe, *edit)) == (edit[0] == "#")


def test_a_kept_run_whose_data_code_changed_since_is_trained_again(tmp_path, monkeypatch):
    source = finished.DATA_SOURCES[0]
    assert not restored_after(tmp_path, monkeypatch, (source, "\n", "\n# edited\n"))


def test_a_kept_run_of_a_commit_without_its_recipe_is_trained_again(tmp_path, monkeypatch):
    conf, commits = history(tmp_path, monkeypatch, (TABLE["supcon-s1"].recipe, "", None))
    made_without = commits[-1]  # the recipe removed, then written back here
    recipe = finished.REPO / conf.recipe
    recipe.write_text((REPO / conf.recipe).read_text())
    write(tmp_path / "kept" / "supcon-s1.json", made(conf, made_without))
    assert not finished.restore(conf, tmp_path / "out", tmp_path / "kept")


def test_a_file_that_is_not_a_kept_run_is_named_and_trained_again(tmp_path, capsys):
    conf = TABLE["supcon-s1"]
    for text in ("{not json", "[1, 2]", '{"evaluation": {}}'):
        (tmp_path / "supcon-s1.json").write_text(text)
        assert not finished.restore(conf, tmp_path / "out", tmp_path)
        assert capsys.readouterr().out == (
            f"{tmp_path / 'supcon-s1'}.json: not a kept run (no JSON object with a "
            "configuration); trained again\n")


@pytest.mark.parametrize("commit, dirty, other, line", [
    (None, None, False, "not kept: made from no git checkout"),
    ("abc", True, False, "not kept: made from a changed tree"),
    (HEAD, False, True, "not kept: of another configuration than the table's")])
def test_only_a_clean_commits_run_of_the_tables_configuration_is_kept(
        tmp_path, capsys, commit, dirty, other, line):
    conf = TABLE["infonce-s0"]
    made_of = dataclasses.replace(conf, seed=7) if other else conf
    write(finished.result_path(conf, tmp_path), made(made_of, commit, dirty))
    assert not finished.keep(conf, tmp_path, tmp_path / "kept")
    assert not (tmp_path / "kept").exists()
    assert capsys.readouterr().out.endswith(f"{line}\n")
    write(finished.result_path(conf, tmp_path), made(conf))
    assert finished.keep(conf, tmp_path, tmp_path / "kept")
    assert finished.kept("infonce-s0", tmp_path / "kept") == made(conf)


def test_the_report_gathers_kept_runs_and_keeps_those_finished_here(tmp_path, monkeypatch):
    """``run_all(kept=True)``: a kept run is read back without training, a run finished
    here is kept, and a configuration with neither is left out of a report."""
    monkeypatch.setattr(finished, "FINISHED", tmp_path / "kept")
    restored, here, missing = TABLE["supcon-s0"], TABLE["supcon-s1"], TABLE["supcon-s2"]
    write(tmp_path / "kept" / "supcon-s0.json", made(restored, knn=0.1))
    write(finished.result_path(here, tmp_path / "out"), made(here, knn=0.2))
    results = run_all([restored, here, missing], {"cluttered": None}, tmp_path / "out",
                      report_only=True, kept=True)
    assert [r["evaluation"]["knn"] for r in results["supcon"]] == [0.1, 0.2]
    assert finished.kept("supcon-s1", tmp_path / "kept")["evaluation"]["knn"] == 0.2
    assert finished.kept("supcon-s2", tmp_path / "kept") is None


@pytest.mark.parametrize("flag", ["--keep", "--record"])
@pytest.mark.parametrize("smoke", [["--set", "train.max_steps=5"], ["--train-samples", "600"]])
def test_a_smoke_run_is_neither_kept_nor_recorded(flag, smoke, tmp_path):
    done = subprocess.run([sys.executable, "-m", "bench.learning", flag, *smoke, "--out",
                           str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                          check=False, timeout=120)
    assert done.returncode == 2
    assert f"{flag} keeps the recipes' runs: leave out --set and the sample counts" in \
        done.stderr


@pytest.mark.parametrize("name", KEPT or ["(none kept)"])
def test_each_kept_run_is_the_tables_configuration_made_at_an_ancestor(name):
    if not KEPT:
        pytest.skip("no run is kept")
    result = finished.kept(name)
    assert name in TABLE, f"{name}: no configuration of the benchmark has this name"
    assert result["configuration"] == json.loads(json.dumps(dataclasses.asdict(TABLE[name])))
    seen = result["provenance"]
    assert re.fullmatch(r"[0-9a-f]{40}", seen["commit"]) and seen["dirty"] is False
    assert git("merge-base", "--is-ancestor", seen["commit"], "HEAD") is not None, \
        f"{name}: made at {seen['commit']}, not an ancestor of HEAD"
    assert "evaluation" in result
