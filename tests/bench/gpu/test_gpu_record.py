"""A GPU kit run becomes the record ``gpu/kit`` with the commit of the tree it ran: its own
where the node had a checkout, else this checkout's, only when its tracked files are those
of HEAD."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from bench.gpu.record import kit_provenance
from bench.records import provenance, tree_digest


def git(cwd, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True,
                          check=True).stdout.strip()


@pytest.fixture
def checkout(tmp_path):
    root = tmp_path / "checkout"
    root.mkdir()
    git(root, "init", "-q")
    (root / "kit.py").write_text("print('measured')\n")
    git(root, "add", "kit.py")
    git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "kit")
    return root


def node_run(commit: str | None, copy=None, dirty: bool = False) -> dict:
    """A kit report as a node writes it: the provenance taken where it ran, and the digest
    of its copy of the tree (``copy``)."""
    seen = {**provenance(["python", "-m", "bench.gpu", "out"]), "commit": commit,
            "dirty": None if commit is None else dirty}
    return {"provenance": seen, "tree_sha256": tree_digest(copy) if copy else "none"}


def node_copy(checkout, tmp_path):
    """The tree as the device tool sends it: its files, no .git."""
    copy = tmp_path / "node"
    shutil.copytree(checkout, copy, ignore=shutil.ignore_patterns(".git"))
    return copy


def test_a_node_without_a_checkout_takes_this_clean_checkouts_commit(checkout, tmp_path):
    seen = kit_provenance(node_run(None, node_copy(checkout, tmp_path)), cwd=checkout)
    assert seen["commit"] == git(checkout, "rev-parse", "HEAD") and seen["dirty"] is False
    assert seen["command"] == "python -m bench.gpu out"  # the node's, not this command's


def test_a_changed_checkout_is_refused_naming_the_file(checkout, tmp_path):
    copy = node_copy(checkout, tmp_path)
    (checkout / "kit.py").write_text("print('changed after the run')\n")
    with pytest.raises(ValueError, match="kit.py"):
        kit_provenance(node_run(None, copy), cwd=checkout)


def test_a_tree_the_node_did_not_run_is_refused(checkout, tmp_path):
    copy = node_copy(checkout, tmp_path)
    (copy / "kit.py").write_text("print('the tree sent before a later commit')\n")
    with pytest.raises(ValueError, match="the node ran another tree"):
        kit_provenance(node_run(None, copy), cwd=checkout)


def test_a_node_with_a_checkout_keeps_its_own_commit_unless_it_was_changed(checkout):
    (checkout / "kit.py").write_text("print('this tree is not the node's')\n")
    assert kit_provenance(node_run("a" * 40), cwd=checkout)["commit"] == "a" * 40
    with pytest.raises(ValueError, match="differed from its commit aaaaaaa"):
        kit_provenance(node_run("a" * 40, dirty=True), cwd=checkout)
