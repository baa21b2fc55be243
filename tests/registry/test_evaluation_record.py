"""The ``evaluation`` tag of a registered version is outside input: every field of a tag
is checked for its type, its range and its length before a card shows it, and a bad field
is refused in one line naming the version and the field, quoting at most 40 characters of
it. ``tests/app/test_model_card.py`` drives the same refusal through ``export``."""

from __future__ import annotations

import json
from dataclasses import asdict, fields

import pytest

from registry.evaluation_record import MAX_TAG_CHARS, EvaluationRecord, card_table
from registry.package import RegistryError

GOOD = EvaluationRecord(date="2026-12-05", run_id="0123abcd", test_shards="test-shards",
                        test_samples=360, train_samples=1437, k=20, knn_top1=0.75,
                        probe_top1=0.8, untrained_knn_top1=0.1, untrained_probe_top1=0.2)
ACCURACIES = [f.name for f in fields(EvaluationRecord) if f.name.endswith("top1")]
COUNTS = ["test_samples", "train_samples", "k"]
TEXTS = ["date", "run_id", "test_shards"]

# (field, bad value, what it is): each field of each kind with each kind of wrong value
BAD = ([(name, value, why) for name in ACCURACIES for value, why in (
            (7, "range: above 1"), (1.0001, "range: above 1"), (-0.01, "range: below 0"),
            (float("nan"), "range: NaN"), (float("inf"), "range: Infinity"),
            ("0.9", "type: a string"), (True, "type: a boolean"), ([0.5], "type: a list"),
            ({"top1": 0.5}, "type: an object"))]
       + [(name, None, "type: missing") for name in ACCURACIES[:2]]  # the required ones
       + [(name, value, why) for name in COUNTS for value, why in (
            (-1, "range: negative"), (2.5, "type: a float"), ("360", "type: a string"),
            (False, "type: a boolean"), (None, "type: missing"))]
       + [(name, value, why) for name in TEXTS for value, why in (
            ("x" * 501, "length: over 500"), (20261205, "type: a number"),
            (["2026-12-05"], "type: a list"), (None, "type: missing"))])


def tag(**changed) -> str:
    return json.dumps({**asdict(GOOD), **changed})


def test_a_good_tag_reads_back_and_fills_the_card():
    assert EvaluationRecord.from_json(tag(), "models:/m/1") == GOOD
    assert "| linear probe top-1 | 80.0% | 20.0% |" in card_table(GOOD)
    bare = EvaluationRecord.from_json(tag(untrained_knn_top1=None, untrained_probe_top1=None),
                                      "models:/m/1")
    assert "| backbone kNN top-1 (k=20) | 75.0% | not measured |" in card_table(bare)


@pytest.mark.parametrize(("name", "value", "why"), BAD,
                         ids=[f"{name}-{why}" for name, _, why in BAD])
def test_a_field_of_the_wrong_type_range_or_length_is_refused_naming_it(name, value, why):
    with pytest.raises(RegistryError) as refused:
        EvaluationRecord.from_json(tag(**{name: value}), "models:/m/1")
    message = str(refused.value)
    assert message.startswith("models:/m/1: the evaluation tag"), message
    assert (f"tag has no {name}" if value is None
            else f"tag's {name} is not a valid ") in message, message
    assert "\n" not in message and "x" * 41 not in message, message


def test_every_field_is_tried():
    assert {name for name, _, _ in BAD} == {f.name for f in fields(EvaluationRecord)}


def test_an_oversized_tag_is_refused_before_it_is_parsed():
    text = tag(test_shards="x" * 300) + " " * MAX_TAG_CHARS
    with pytest.raises(RegistryError, match=f"more than {MAX_TAG_CHARS}"):
        EvaluationRecord.from_json(text, "models:/m/1")
