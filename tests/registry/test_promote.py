"""Promotion against a real SQLite model registry."""

from __future__ import annotations

import mlflow
import pytest

from registry.promote import promote


@pytest.fixture
def client(tmp_path):
    """A real SQLite registry with versions 1, 2 and 3 of model "enc"."""
    uri = f"sqlite:///{tmp_path / 'registry.db'}"
    client = mlflow.MlflowClient(uri, registry_uri=uri)
    client.create_registered_model("enc")
    for _ in range(3):
        client.create_model_version("enc", source=str(tmp_path), run_id=None)
    return client


def test_better_version_takes_the_alias_worse_does_not(client):

    first = promote(client, "enc", "1", "champion", 0.80)
    assert first["promoted"] and first["reason"] == "alias was unset"
    worse = promote(client, "enc", "2", "champion", 0.75)
    assert not worse["promoted"]
    assert (worse["holder"], worse["holder_score"]) == ("1", 0.80)
    assert str(client.get_model_version_by_alias("enc", "champion").version) == "1"
    better = promote(client, "enc", "3", "champion", 0.90)
    assert better["promoted"]
    assert str(client.get_model_version_by_alias("enc", "champion").version) == "3"
    tags = client.get_model_version("enc", "2").tags
    assert tags["knn_top1"] == "0.75"
    assert tags["promotion.champion"] == "not promoted: 0.75 <= 0.8 of version 1"
    assert client.get_model_version("enc", "3").tags["promotion.champion"].startswith(
        "promoted: 0.9 > 0.8")


def test_scores_compare_unrounded_and_a_tie_keeps_the_holder(client):
    score = 0.8123456789012345
    assert promote(client, "enc", "1", "champion", score)["promoted"]
    assert float(client.get_model_version("enc", "1").tags["knn_top1"]) == score  # exact
    tie = promote(client, "enc", "2", "champion", score)  # an identical model
    assert not tie["promoted"] and tie["holder_score"] == score
    finer = promote(client, "enc", "3", "champion", score + 1e-12)  # beyond 6 decimals
    assert finer["promoted"]
    assert str(client.get_model_version_by_alias("enc", "champion").version) == "3"
