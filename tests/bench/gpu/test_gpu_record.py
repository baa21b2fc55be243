"""A GPU kit run becomes the record ``gpu/kit`` with the commit of the tree it ran: its own
where the node had a checkout, else this checkout's, only when its tracked files are those
of HEAD."""

from __future__ import annotations

import subprocess

import pytest

from bench.gpu.record import kit_provenance
from bench.records import provenance


def git(cwd, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True,
                          check=True).stdout.strip()


@pytest.fixture
def checkout(tmp_path):
    git(tmp_path, "init", "-q")
    (tmp_path / "kit.py").write_text("print('measured')\n")
    git(tmp_path, "add", "kit.py")
    git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "kit")
    return tmp_path


def node_run(commit: str | None) -> dict:
    """A kit report as a node writes it: the provenance taken where it ran."""
    seen = {**provenance(["python", "-m", "bench.gpu", "out"]), "commit": commit,
            "dirty": None if commit is None else False}
    return {"provenance": seen}


def test_a_node_without_a_checkout_takes_this_clean_checkouts_commit(checkout):
    seen = kit_provenance(node_run(None), cwd=checkout)
    assert seen["commit"] == git(checkout, "rev-parse", "HEAD") and seen["dirty"] is False
    assert seen["command"] == "python -m bench.gpu out"  # the node's, not this command's


def test_a_changed_checkout_is_refused_naming_the_file(checkout):
    (checkout / "kit.py").write_text("print('changed after the run')\n")
    with pytest.raises(ValueError, match="kit.py"):
        kit_provenance(node_run(None), cwd=checkout)


def test_a_node_with_a_checkout_keeps_its_own_commit(checkout):
    (checkout / "kit.py").write_text("print('this tree is not the node's')\n")
    assert kit_provenance(node_run("a" * 40), cwd=checkout)["commit"] == "a" * 40
