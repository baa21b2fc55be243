"""The suite's disk: what its fixtures write, and a bound on what it holds at once.

A test's own ``tmp_path`` goes when it passes (``tmp_path_retention_policy = "failed"`` in
pyproject.toml). A fixture wider than a test (a module's trained run, a package's server
store) makes its directory with :func:`scratch_dir`, which removes it when the fixture
ends. What a worker's scratch holds after each file is measured against
:data:`BUDGET_BYTES`: a fixture that keeps what it no longer needs fails the file that
left it, by name, instead of filling CI's disk an hour later."""

from __future__ import annotations

import os
import shutil
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

# A worker holds the session's digits shards and reference runs (about 0.5 GB) plus one
# file's fixtures; a whole suite on 2 workers then stays under 2 x 1.5 GB beside the venv.
BUDGET_BYTES = 1536 * 2**20


@contextmanager
def scratch_dir(factory: pytest.TempPathFactory, name: str) -> Iterator[Path]:
    """A fresh directory under the session's base, removed when the ``with`` ends."""
    path = factory.mktemp(name)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def size_of_tree(root: Path) -> int:
    """Bytes of the regular files under ``root`` (links not followed)."""
    total = 0
    for folder, _, files in os.walk(root):
        for name in files:
            try:
                status = os.lstat(os.path.join(folder, name))
            except OSError:
                continue  # removed while walked
            if stat.S_ISREG(status.st_mode):
                total += status.st_size
    return total


def largest_entries(root: Path, count: int = 3) -> list[tuple[str, int]]:
    """The ``count`` largest entries directly under ``root`` (links aside), with their
    sizes."""
    sizes = [(entry.name, size_of_tree(entry) if entry.is_dir() else entry.lstat().st_size)
             for entry in root.iterdir() if not entry.is_symlink()]
    return sorted(sizes, key=lambda pair: -pair[1])[:count]


def over_budget(root: Path, after: str, budget: int = BUDGET_BYTES) -> str | None:
    """The complaint when the scratch under ``root`` holds more than ``budget`` bytes after
    the file ``after``; None when within it."""
    held = size_of_tree(root)
    if held <= budget:
        return None
    biggest = ", ".join(f"{name} {size / 2**20:.0f} MiB" for name, size in largest_entries(root))
    return (f"the suite's scratch holds {held / 2**20:.0f} MiB after {after} (budget "
            f"{budget / 2**20:.0f} MiB; largest: {biggest}): a fixture keeps a directory it "
            f"no longer needs; make it with tests.scratch.scratch_dir")
