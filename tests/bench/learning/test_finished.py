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


def recipe_history(tmp_path, monkeypatch, *edits) -> tuple[runs.Configuration, list[str]]:
    """A checkout of its own holding supcon-s1's recipe, committed as read here and then
    after each edit (old text, new text); :mod:`finished` reads it. The commits, oldest
    first."""
    conf, repo = TABLE["supcon-s1"], tmp_path / "repo"
    recipe = repo / conf.recipe
    recipe.parent.mkdir(parents=True)
    recipe.write_text((REPO / conf.recipe).read_text())
    for command in (["init", "-q"], ["config", "user.email", "t@t"], ["config", "user.name", "t"]):
        git(*command, cwd=repo)
    commits = []
    for old, new in [("", ""), *edits]:
        recipe.write_text(recipe.read_text().replace(old, new, 1) if old else recipe.read_text())
        git("add", "-A", cwd=repo)
        git("commit", "-q", "--allow-empty", "-m", "recipe", cwd=repo)
        commits.append(git("rev-parse", "HEAD", cwd=repo))
    monkeypatch.setattr(finished, "REPO", repo)
    return conf, commits


def test_a_kept_run_whose_recipe_changed_since_is_trained_again(tmp_path, monkeypatch, capsys):
    conf, (before, _) = recipe_history(tmp_path, monkeypatch, ("temperature: 0.2",
                                                               "temperature: 0.3"))
    write(tmp_path / "kept" / "supcon-s1.json", made(conf, before))
    assert not finished.restore(conf, tmp_path / "out", tmp_path / "kept")
    assert capsys.readouterr().out == (
        f"{tmp_path / 'kept' / 'supcon-s1'}.json: its recipe or data code changed since "
        f"{before[:7]}; trained again\n")


def test_a_kept_run_whose_recipe_changed_only_in_its_comments_is_restored(tmp_path, monkeypatch):
    conf, (before, _) = recipe_history(tmp_path, monkeypatch, ("# ", "# (reworded) "))
    write(tmp_path / "kept" / "supcon-s1.json", made(conf, before))
    assert finished.restore(conf, tmp_path / "out", tmp_path / "kept")


def test_a_kept_run_of_a_commit_without_its_recipe_is_trained_again(tmp_path, monkeypatch):
    conf, _ = recipe_history(tmp_path, monkeypatch)
    write(tmp_path / "kept" / "supcon-s1.json", made(conf, "0" * 40))
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
