"""The suite's disk bound (tests/scratch.py) against sizes written here."""

from __future__ import annotations

from tests.scratch import over_budget, scratch_dir, size_of_tree


def test_a_scratch_dir_is_removed_when_its_fixture_ends(tmp_path_factory):
    with scratch_dir(tmp_path_factory, "kept-while-inside") as root:
        (root / "inner").mkdir()
        (root / "inner" / "weights").write_bytes(b"\0" * 1000)
        assert size_of_tree(root) == 1000
    assert not root.exists()


def test_over_budget_names_the_file_and_the_largest_entries(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "checkpoint").write_bytes(b"\0" * 3 * 2**20)
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards" / "a.tar").write_bytes(b"\0" * 2**20)
    (tmp_path / "to_weights").symlink_to(tmp_path / "run" / "checkpoint")  # not counted
    assert size_of_tree(tmp_path) == 4 * 2**20
    assert over_budget(tmp_path, "tests/x.py", budget=4 * 2**20) is None
    complaint = over_budget(tmp_path, "tests/x.py", budget=2**20)
    assert complaint.startswith("the suite's scratch holds 4 MiB after tests/x.py (budget "
                                "1 MiB; largest: run 3 MiB, shards 1 MiB)")
