"""Shard folders written by someone else: a manifest names only plain files of its own
folder (a ``pipe:`` name never runs, an absolute name is never opened), a run with too
many bad samples stops in one line naming the shard and the reason, and remote shards are
checked against the manifest's checksums when ``data.verify_checksums`` is on."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections import Counter

import pytest

from data_pipeline.config import DataConfig
from data_pipeline.formats import Sample
from data_pipeline.loader import eval_batches, train_batches
from data_pipeline.manifest import ManifestError
from data_pipeline.shards import ShardSet
from tests.app.helpers import pretrain_command, run_pretrain, train_overrides
from tests.data_pipeline.helpers import digit_sample, uneven_set, write_set
from tests.data_pipeline.remote import ShardServer


def hostile_manifest(folder, name: str) -> None:
    """A manifest listing ``name`` (a file of that name exists, its size right)."""
    uneven_set(folder, [20])
    manifest = json.loads((folder / "manifest.json").read_text())
    size = manifest["shards"][0]["bytes"]
    manifest["shards"].append({"name": name, "samples": 1, "bytes": size, "sha256": "0" * 64})
    (folder / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("name", ["pipe:touch PIPE_RAN", "/etc/hostname", "../shard.tar",
                                  "sub/shard.tar", "s3:x.tar", "..", "-rf", "a\nb.tar"])
def test_a_manifest_naming_anything_but_a_plain_file_is_refused_before_reading(
        tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    hostile_manifest(tmp_path, name)
    with pytest.raises(ManifestError, match=r"manifest.json: shard name .* is not a plain file "
                                            "name inside the manifest's folder"):
        ShardSet.open(".")
    assert not (tmp_path / "PIPE_RAN").exists()


def test_the_pretrain_command_refuses_a_pipe_manifest_in_one_line(tmp_path):
    shards = tmp_path / "shards"
    hostile_manifest(shards, "pipe:touch PIPE_RAN")
    shutil.copy(shards / "shard-000000.tar", shards / "pipe:touch PIPE_RAN")
    result = subprocess.run(pretrain_command(train_overrides(".", tmp_path / "out")),
                            cwd=shards, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith(
        "pretrain: error: manifest.json: shard name 'pipe:touch PIPE_RAN' is not a plain")
    assert not (shards / "PIPE_RAN").exists()


def test_too_many_bad_samples_stop_the_run_in_one_line_naming_shard_and_reason(tmp_path):
    good = [digit_sample(i) for i in range(40)]
    bad = [Sample(f"bad{i:04d}", b"\xff\xd8 not a jpeg", "jpg", 0) for i in range(40)]
    write_set(tmp_path / "shards", [good, bad], [str(i) for i in range(10)])
    result = run_pretrain(train_overrides(tmp_path / "shards", tmp_path / "out",
                                          **{"train.max_steps": 4, "data.lanes": 1}))
    assert result.returncode == 1, result.stderr[-2000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("pretrain: error: ") and "skipped (> data.max_skip_fraction=0.01)" \
        in last and "last in shard shard-000001.tar (corrupt_image)" in last, last


def test_remote_shards_are_checked_against_the_manifest_s_checksums(tmp_path):
    """A shard replaced on the server (same size, other bytes) is skipped whole and counted
    as checksum_mismatch with verify_checksums; read as it is without."""
    folder = tmp_path / "shards"
    uneven_set(folder, [30, 20, 14])
    tampered = folder / "shard-000001.tar"
    replacement = tmp_path / "other"
    write_set(replacement, [[digit_sample(i, key=f"x{i:05d}") for i in range(500, 520)]])
    data = (replacement / "shard-000000.tar").read_bytes()
    size = tampered.stat().st_size
    tampered.write_bytes(data[:size].ljust(size, b"\0"))
    server = ShardServer(folder).start()
    try:
        url = f"{server.url}/shard-{{000000..000002}}.tar"
        assert len(ShardSet.open(url).checksums) == 3
        base = {"shards": url, "batch_size": 8, "workers": 0, "resolution": 16,
                "shuffle_buffer": 16, "retries": 2, "retry_wait": 0.05,
                "max_skip_fraction": 1.0}
        skipped: Counter = Counter()
        keys = [k for b in eval_batches(DataConfig(**base, verify_checksums=True),
                                        skipped=skipped) for k in b["keys"]]
        assert skipped == {"checksum_mismatch": 20} and len(keys) == 44
        assert not any(k.startswith("x") for k in keys)
        train = [b for b in train_batches(DataConfig(**base, verify_checksums=True))]
        counted = Counter()
        for batch in train:
            counted.update(batch["skipped"])
        assert counted["checksum_mismatch"] == 20
        assert any("SHA-256" in e for b in train for e in b["skipped_examples"])
        unchecked = [k for b in eval_batches(DataConfig(**base)) for k in b["keys"]]
        assert any(k.startswith("x") for k in unchecked)  # without the check it is read
    finally:
        server.stop()
