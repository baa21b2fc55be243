"""The registered encoder and its server, shared by the serving tests of a module."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.data_pipeline.helpers import digit_sample
from tests.scratch import scratch_dir
from tests.serving.helpers import registered_encoder, serving


@pytest.fixture(scope="package")
def store(digits_shards, tmp_path_factory) -> Iterator[Path]:
    with scratch_dir(tmp_path_factory, "served") as root:
        yield registered_encoder(digits_shards, root)


@pytest.fixture(scope="package")
def image_root(tmp_path_factory) -> Path:
    """The path root: one JPEG, a FIFO, a folder, links out of it."""
    root = tmp_path_factory.mktemp("images")
    (root / "ok.jpg").write_bytes(digit_sample(2).image)
    os.mkfifo(root / "fifo")
    (root / "folder").mkdir()
    (root / "to_hostname").symlink_to("/etc/hostname")
    (root / "to_zero").symlink_to("/dev/zero")
    (root / "inside").symlink_to(root / "ok.jpg")
    return root


@pytest.fixture(scope="package")
def server(store, image_root, tmp_path_factory):
    with scratch_dir(tmp_path_factory, "serve") as root, \
            serving(store, "models:/served/1", root, "--path-root", str(image_root)) as running:
        yield running
