"""The lookup every table of extensions uses: the entry, or one line naming the key and
every choice."""

from __future__ import annotations

import pytest

from core.config import InvalidValue
from core.tables import table_entry


def test_an_entry_is_returned_by_its_name():
    assert table_entry({"a": 1, "b": 2}, "b", "name", "thing") == 2


@pytest.mark.parametrize(("table", "choices"), [({"a": 1}, "a"), ({"a": 1, "b": 2}, "a or b"),
                                                ({"a": 1, "b": 2, "c": 3}, "a, b or c")])
def test_an_unknown_name_names_the_key_and_every_choice(table, choices):
    with pytest.raises(InvalidValue) as err:
        table_entry(table, "z", "name", "thing")
    assert err.value.field == "name"
    assert str(err.value) == f"unknown thing 'z'; choose one of {choices}"
