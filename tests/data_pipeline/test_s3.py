"""``s3://`` shards read as open_clip reads them (``aws s3 cp <url> -``), against a real
S3 API on 127.0.0.1 (moto's server) with the real AWS command line: brace lists with a
manifest beside them, img2dataset stats, and a missing object that fails naming the URL."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import boto3
import pytest
import torch
from moto.server import ThreadedMotoServer

from data_pipeline.config import DataConfig, Retry
from data_pipeline.loader import eval_batches, train_batches
from data_pipeline.shards import ShardSet
from data_pipeline.tario import ShardUnreachable, iter_shard
from tests.data_pipeline.helpers import uneven_set
from tests.data_pipeline.remote import free_port, img2dataset_shards

BUCKET = "contrastive-shards"


@pytest.fixture
def bucket(monkeypatch):
    """An S3 endpoint on 127.0.0.1 with an empty bucket; ``aws`` and boto3 point at it."""
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port,
                                            verbose=False)
    server.start()
    for key, value in {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
                       "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
                       "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(key, value)
    # the `aws` command installed beside this interpreter (the venv's bin)
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    client = boto3.client("s3")
    client.create_bucket(Bucket=BUCKET)
    yield client
    server.stop()


def upload(client, folder: Path, prefix: str) -> None:
    for path in sorted(folder.iterdir()):
        client.upload_file(str(path), BUCKET, f"{prefix}/{path.name}")


def config(shards, **kw) -> DataConfig:
    base = {"shards": str(shards), "batch_size": 8, "workers": 2, "resolution": 16,
            "shuffle_buffer": 16, "retries": 2, "retry_wait": 0.05}
    return DataConfig(**(base | kw))


def test_s3_brace_list_gives_what_the_folder_gives(bucket, tmp_path):
    folder = tmp_path / "shards"
    uneven_set(folder, [30, 20, 14])
    upload(bucket, folder, "digits")
    url = f"s3://{BUCKET}/digits/shard-{{000000..000002}}.tar"
    listed = ShardSet.open(url)
    assert listed.counts == [30, 20, 14]  # from the manifest beside the shards
    assert listed.class_names == ShardSet.open(folder).class_names
    for read in (eval_batches, train_batches):
        local = [(b["keys"], b["images"]) for b in read(config(folder))]
        remote = [(b["keys"], b["images"]) for b in read(config(url))]
        assert [k for k, _ in remote] == [k for k, _ in local]
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(local, remote, strict=True))


def test_s3_img2dataset_counts_come_from_its_stats(bucket, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    keys = img2dataset_shards(tmp_path / "web", shards=2, per_shard=7)
    upload(bucket, tmp_path / "web", "cc3m")
    url = f"s3://{BUCKET}/cc3m/{{00000..00001}}.tar"
    assert ShardSet.open(url).counts == [7, 7]
    read = [s["__key__"] for s in iter_shard(f"s3://{BUCKET}/cc3m/00001.tar")]
    assert sorted(read) == sorted(k for k in keys if k.startswith("01"))


def test_a_missing_s3_object_fails_naming_the_url(bucket):
    url = f"s3://{BUCKET}/nowhere/00000.tar"
    with pytest.raises(ShardUnreachable, match=f"{url}: unreachable after 2 attempts "
                                               r"\(aws exit status 1\)"):
        list(iter_shard(url, Retry(attempts=2, wait=0.05)))
