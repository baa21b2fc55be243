"""Faults found after the configuration checks: one line naming the key or file and what to
do, exit status 1, and no stray run directory (the real ``pretrain`` entry point)."""

from __future__ import annotations

import dataclasses

import pytest

from app.pretrain import main as pretrain_main
from tests.app.helpers import run_pretrain, train_overrides
from tests.data_pipeline.helpers import digit_sample, write_set


def fails_with(overrides: list[str], capsys: pytest.CaptureFixture) -> str:
    """Run ``pretrain`` in this process; returns the last line it wrote to stderr."""
    with pytest.raises(SystemExit) as exit_info:
        pretrain_main(overrides)
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


def test_missing_manifest(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    line = fails_with(train_overrides(tmp_path / "empty", tmp_path), capsys)
    assert line == (f"pretrain: error: {tmp_path / 'empty' / 'manifest.json'}: no manifest "
                    "(run make-shards first)")
    assert not (tmp_path / "run").exists()


def test_batch_larger_than_the_data(digits_shards, tmp_path, capsys):
    line = fails_with(train_overrides(digits_shards, tmp_path, **{"data.batch_size": 400}),
                      capsys)
    assert line == (f"pretrain: error: data.batch_size=400 on 1 ranks needs 400 samples per "
                    f"step and data.shards={digits_shards} holds 360: lower data.batch_size")
    assert not (tmp_path / "run").exists()


def test_missing_class_graph(digits_shards, tmp_path, capsys):
    graph = tmp_path / "nowhere.npz"
    line = fails_with(train_overrides(digits_shards, tmp_path, **{
        "objective.name": "xclr", "objective.xclr.class_graph": graph}), capsys)
    assert line == (f"pretrain: error: objective.xclr.class_graph={graph}: no such file (run "
                    "graph-precompute graph.task=class_graph)")
    assert not (tmp_path / "run").exists()


def test_an_existing_run_directory_is_kept(digits_shards, tmp_path, capsys):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "notes.txt").write_text("mine")
    fails_with(train_overrides(digits_shards, tmp_path, **{"data.batch_size": 400}), capsys)
    assert (tmp_path / "run" / "notes.txt").read_text() == "mine"


def test_more_negatives_than_candidates_warns_once(digits_shards, tmp_path):
    result = run_pretrain(train_overrides(digits_shards, tmp_path, **{
        "objective.num_negatives": 30, "train.max_steps": 2}))  # 2 x 16 views - 2 = 30
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr.count("objective.num_negatives=30 is at least the 30 candidates "
                               "per anchor at global batch 16") == 1


def test_learned_class_embeddings_need_shards_that_list_classes(tmp_path, capsys):
    manifest = write_set(tmp_path / "unlabelled", [[digit_sample(i) for i in range(40)]])
    dataclasses.replace(manifest, class_names=[]).write(tmp_path / "unlabelled")
    line = fails_with(train_overrides(tmp_path / "unlabelled", tmp_path, **{
        "objective.name": "projnce", "objective.projnce.projection": "learned"}), capsys)
    assert line == (f"pretrain: error: objective.name=projnce needs class labels, and "
                    f"data.shards={tmp_path / 'unlabelled'} lists no classes (no manifest "
                    "with class names)")
    assert not (tmp_path / "run").exists()
