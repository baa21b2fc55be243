"""A real small file system for disk-full tests: a tmpfs mounted on a test's directory.
Writes past its size fail with ENOSPC as on a full disk. Mounting needs root (CI and this
project's machines run tests as root); elsewhere the tests that need it are skipped."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


def _mount(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(["mount", *args], capture_output=True, text=True)


@contextmanager
def small_disk(path: Path, size_bytes: int) -> Iterator[Path]:
    """``path`` as a file system of ``size_bytes`` (rounded up to pages) while inside."""
    path.mkdir(parents=True, exist_ok=True)
    try:
        mounted = _mount(["-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(path)])
    except FileNotFoundError:
        pytest.skip("a full-disk test mounts a tmpfs: no mount command here")
    if mounted.returncode != 0:
        pytest.skip(f"a full-disk test mounts a tmpfs, which needs root: {mounted.stderr}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "--lazy", str(path)], check=True)


def resize(path: Path, size_bytes: int) -> None:
    """Grow (or shrink) the small disk at ``path``, as a user freeing space would."""
    done = _mount(["-o", f"remount,size={size_bytes}", str(path)])
    assert done.returncode == 0, done.stderr
