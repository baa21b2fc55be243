"""Shards from URLs: brace lists over a real HTTP server on 127.0.0.1, counts without a
manifest, retries across a server that is killed and restarted, one-line failure when it
stays down."""

from __future__ import annotations

import logging
import re
import threading
from collections import Counter

import pytest
import torch

from data_pipeline.config import DataConfig, Retry
from data_pipeline.loader import eval_batches, train_batches
from data_pipeline.shards import ShardSet, cache_path, expand
from data_pipeline.tario import ShardUnreachable, iter_shard, open_url
from tests.data_pipeline.helpers import uneven_set
from tests.data_pipeline.remote import ShardServer, img2dataset_shards

FAST = Retry(attempts=3, wait=0.05)


@pytest.fixture
def served(tmp_path):
    uneven_set(tmp_path / "shards", [30, 20, 14])
    server = ShardServer(tmp_path / "shards").start()
    yield tmp_path / "shards", server
    server.stop()


def config(shards, **kw) -> DataConfig:
    base = {"shards": str(shards), "batch_size": 8, "workers": 2, "resolution": 16,
            "shuffle_buffer": 16, "retries": 3, "retry_wait": 0.05}
    return DataConfig(**(base | kw))


def test_brace_list_over_http_gives_what_the_folder_gives(served):
    folder, server = served
    url = f"{server.url}/shard-{{000000..000002}}.tar"
    listed = ShardSet.open(url)
    assert listed.urls == [f"{server.url}/shard-{i:06d}.tar" for i in range(3)]
    assert listed.counts == [30, 20, 14]  # from the manifest beside the shards
    assert listed.class_names == ShardSet.open(folder).class_names
    assert ShardSet.class_names_of(url) == listed.class_names  # from the manifest alone
    for read in (eval_batches, train_batches):
        local = [(b["keys"], b["images"]) for b in read(config(folder))]
        remote = [(b["keys"], b["images"]) for b in read(config(url))]
        assert [k for k, _ in remote] == [k for k, _ in local]
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(local, remote, strict=True))


def test_counts_from_img2dataset_stats_or_a_counting_pass_cost_one_request_per_shard(
        tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    img2dataset_shards(tmp_path / "web" / "stats", shards=2, per_shard=7)
    img2dataset_shards(tmp_path / "web" / "bare", shards=2, per_shard=5)
    for stats in (tmp_path / "web" / "bare").glob("*_stats.json"):
        stats.unlink()
    server = ShardServer(tmp_path / "web").start()
    stats_url, bare_url = (f"{server.url}/{d}/{{00000..00001}}.tar" for d in ("stats", "bare"))
    try:
        for _ in range(3):  # a run opens its list several times; only the first asks
            assert ShardSet.open(stats_url).counts == [7, 7]  # successes of *_stats.json
            assert ShardSet.open(bare_url).counts == [5, 5]  # counted
        asked = Counter(path for path in server.requests() if path != "/")
    finally:
        server.stop()
    assert asked == {"/stats/00000_stats.json": 1, "/stats/00001_stats.json": 1,
                     "/bare/00000_stats.json": 1, "/bare/00001_stats.json": 1,
                     "/bare/00000.tar": 1, "/bare/00001.tar": 1,
                     "/stats/manifest.json": 3, "/bare/manifest.json": 3}
    assert cache_path().is_file()
    for url, counts in ((stats_url, [7, 7]), (bare_url, [5, 5])):  # no server needed now
        assert ShardSet.open(url, retry=FAST).counts == counts


def test_a_server_killed_mid_shard_is_retried_and_the_read_resumes_exactly(tmp_path, caplog):
    img2dataset_shards(tmp_path / "web", shards=1, per_shard=3000)  # ~3 MB: outlasts buffers
    local = list(iter_shard(tmp_path / "web" / "00000.tar"))
    server = ShardServer(tmp_path / "web").start()
    samples = iter_shard(f"{server.url}/00000.tar", Retry(attempts=6, wait=0.2))
    remote = [next(samples) for _ in range(5)]
    server.stop()  # the connection dies with most of the shard unsent
    restart = threading.Timer(1.0, server.start)
    restart.start()
    with caplog.at_level(logging.WARNING, logger="data_pipeline.tario"):
        remote += list(samples)
    restart.join()
    server.stop()
    assert [s["__key__"] for s in remote] == [s["__key__"] for s in local]
    assert all(a == b for a, b in zip(remote, local, strict=True))
    failed_at = int(re.search(r"failed after (\d+) samples", caplog.text).group(1))
    assert 5 <= failed_at < 3000  # cut mid-shard (curl had buffered some samples ahead)
    assert "retry 1 of 5" in caplog.text


def test_a_server_that_stays_down_fails_naming_the_url(served):
    _, server = served
    url = f"{server.url}/shard-000001.tar"
    server.stop()
    with pytest.raises(ShardUnreachable, match=f"{url}: unreachable after 3 attempts"):
        list(iter_shard(url, FAST))


def test_url_forms():
    assert expand("http://h/a-{00..02}.tar::gs://b/x.tar") == [
        "http://h/a-00.tar", "http://h/a-01.tar", "http://h/a-02.tar", "gs://b/x.tar"]
    pipe = open_url("pipe:printf shard-bytes")
    assert pipe.read() == b"shard-bytes"
    pipe.close()
