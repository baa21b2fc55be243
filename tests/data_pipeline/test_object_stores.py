"""``s3://`` and ``gs://`` shards read as open_clip reads them (``aws s3 cp <url> -``,
``gsutil cat <url>``), against real APIs on 127.0.0.1 (moto's S3 server; gcp-storage-
emulator's JSON API behind TLS) with the real command-line tools: brace lists with a
manifest beside them, img2dataset stats, and a missing object that fails naming the URL."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import boto3
import pytest
import torch
from moto.server import ThreadedMotoServer

from data_pipeline.config import DataConfig, Retry
from data_pipeline.loader import eval_batches, train_batches
from data_pipeline.shards import ShardSet
from data_pipeline.tario import ShardUnreachable, iter_shard
from tests.data_pipeline.gcs import GcsEndpoint
from tests.data_pipeline.helpers import uneven_set
from tests.data_pipeline.remote import img2dataset_shards
from tests.ports import free_port
from tests.scratch import scratch_dir

BUCKET = "contrastive-shards"


@dataclass
class Store:
    scheme: str  # "s3" or "gs"
    tool: str  # the command that reads it
    put: Callable[[str, bytes], None]  # (object name, data)

    def upload(self, folder: Path, prefix: str) -> None:
        for path in sorted(folder.iterdir()):
            self.put(f"{prefix}/{path.name}", path.read_bytes())

    def url(self, name: str) -> str:
        return f"{self.scheme}://{BUCKET}/{name}"


def s3_store(monkeypatch, tmp_path) -> tuple[Store, Callable[[], None]]:
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    for key, value in {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
                       "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
                       "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(key, value)
    client = boto3.client("s3")
    client.create_bucket(Bucket=BUCKET)
    return Store("s3", "aws", lambda name, data: client.put_object(
        Bucket=BUCKET, Key=name, Body=data)), server.stop


def gs_store(monkeypatch, tmp_path) -> tuple[Store, Callable[[], None]]:
    endpoint = GcsEndpoint(tmp_path)
    endpoint.create_bucket(BUCKET)
    monkeypatch.setenv("BOTO_CONFIG", str(endpoint.boto_config))
    return Store("gs", "gsutil", lambda name, data: endpoint.upload(BUCKET, name, data)), \
        endpoint.stop


@pytest.fixture(params=["s3", "gs"])
def store(request, monkeypatch, tmp_path_factory):
    """An object store on 127.0.0.1 with an empty bucket; its command line points at it."""
    # the command-line tools installed beside this interpreter (the venv's bin)
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    make = s3_store if request.param == "s3" else gs_store
    with scratch_dir(tmp_path_factory, request.param) as root:
        made, stop = make(monkeypatch, root)
        yield made
        stop()


def config(shards, **kw) -> DataConfig:
    base = {"shards": str(shards), "batch_size": 8, "workers": 2, "resolution": 16,
            "shuffle_buffer": 16, "retries": 2, "retry_wait": 0.05}
    return DataConfig(**(base | kw))


def test_brace_list_gives_what_the_folder_gives(store, tmp_path):
    folder = tmp_path / "shards"
    uneven_set(folder, [30, 20, 14])
    store.upload(folder, "digits")
    url = store.url("digits/shard-{000000..000002}.tar")
    listed = ShardSet.open(url)
    assert listed.counts == [30, 20, 14]  # from the manifest beside the shards
    assert listed.class_names == ShardSet.open(folder).class_names
    for read in (eval_batches, train_batches):
        local = [(b["keys"], b["images"]) for b in read(config(folder))]
        remote = [(b["keys"], b["images"]) for b in read(config(url))]
        assert [k for k, _ in remote] == [k for k, _ in local]
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(local, remote, strict=True))


def test_img2dataset_counts_come_from_its_stats(store, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    keys = img2dataset_shards(tmp_path / "web", shards=2, per_shard=7)
    store.upload(tmp_path / "web", "cc3m")
    assert ShardSet.open(store.url("cc3m/{00000..00001}.tar")).counts == [7, 7]
    read = [s["__key__"] for s in iter_shard(store.url("cc3m/00001.tar"))]
    assert sorted(read) == sorted(k for k in keys if k.startswith("01"))


def test_a_missing_object_fails_naming_the_url(store):
    url = store.url("nowhere/00000.tar")
    with pytest.raises(ShardUnreachable, match=f"{url}: unreachable after 2 attempts "
                                               rf"\({store.tool} exit status 1\)"):
        list(iter_shard(url, Retry(attempts=2, wait=0.05)))
