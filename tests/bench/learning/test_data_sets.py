"""The learning benchmark makes a data set (shards, caption stores) only when a part reads
it, and once."""

from __future__ import annotations

from bench.learning.__main__ import DataSets


def test_a_data_set_is_made_when_first_read_and_once():
    made: list[str] = []

    def maker(name: str):
        return lambda: made.append(name) or f"{name} set"

    sets = DataSets({name: maker(name) for name in ("cluttered", "alt_text", "digits")})
    assert made == [] and list(sets) == ["cluttered", "alt_text", "digits"]
    assert sets["digits"] == "digits set" and sets["digits"] == "digits set"
    assert made == ["digits"]
