"""The caption store read as a loader worker reads it: at most about the drop budget of
its memory-mapped pages stays resident (``/proc/self/smaps``), the key pages are dropped at
each budget crossing, and an empty store finds nothing."""

from __future__ import annotations

import json

import numpy as np

from data_pipeline.graph import pages
from data_pipeline.graph.store import CaptionStore
from tests.data_pipeline.graph.test_pages import MIB, mapped_resident_bytes


def test_a_pass_over_the_store_keeps_about_a_budget_of_its_pages(tmp_path, monkeypatch):
    """A loader worker looks up every sample's key and reads every batch's rows: through
    the store, at most about the drop budget of its pages stays resident (a plain memory
    map keeps every page a pass touched, here 5.9 MiB of keys and 7.3 MiB of embeddings)."""
    monkeypatch.setattr(pages, "DROP_BYTES", MIB)
    n, unique = 200_000, 10_000
    keys = np.array([f"sample-{i:09d}-{'x' * 14}".encode() for i in range(n)])  # 32 bytes
    rng = np.random.default_rng(0)
    directory = tmp_path / "store"
    directory.mkdir()
    np.save(directory / "keys.npy", keys)
    np.save(directory / "rows.npy", rng.integers(0, unique, n).astype(np.int32))
    np.save(directory / "embeddings.npy", rng.normal(size=(unique, 384)).astype(np.float16))
    (directory / "meta.json").write_text(json.dumps({"num_keys": n, "num_unique": unique,
                                                     "dim": 384}))
    store = CaptionStore.open(directory)
    assert mapped_resident_bytes(directory / "rows.npy") <= pages.FAULT_AROUND_BYTES
    plain = np.load(directory / "embeddings.npy", mmap_mode="r")
    order = rng.permutation(n)
    for start in range(0, n, 20_000):
        np.searchsorted(store.keys, keys[order[start:start + 20_000]])
    np.array(plain[rng.permutation(unique)])
    assert mapped_resident_bytes(directory / "keys.npy") > 5.5 * MIB
    assert mapped_resident_bytes(directory / "embeddings.npy") > 7 * MIB
    del plain
    pages.drop_pages(store.keys)
    want = np.load(directory / "embeddings.npy")
    for start in range(0, n, 256):  # a worker's lookups, one key a sample, then its batch
        batch = keys[order[start:start + 256]]
        rows = [int(store.find([key.decode()])[0][0]) for key in batch]
        np.testing.assert_array_equal(store.embedding_rows(rows), want[rows])
    for name in ("keys.npy", "embeddings.npy"):
        assert mapped_resident_bytes(directory / name) <= 2 * MIB, name


def write_store(directory, keys: list[str]) -> None:
    directory.mkdir()
    np.save(directory / "keys.npy", np.array(sorted(k.encode() for k in keys), dtype="S8"))
    np.save(directory / "rows.npy", np.zeros(len(keys), np.int32))
    np.save(directory / "embeddings.npy", np.zeros((1, 4), np.float16))
    (directory / "meta.json").write_text(json.dumps({"num_keys": len(keys), "num_unique": 1,
                                                     "dim": 4}))


def test_lookups_drop_the_key_pages_each_time_their_estimate_reaches_the_budget(
        tmp_path, monkeypatch):
    """1,000 keys: a key's search costs (ceil(log2 1,001) + 1) = 11 windows of 64 KiB, so
    a budget of 5 keys' worth drops at every 5th key, a batch of 12 keys once."""
    drops = []
    monkeypatch.setattr(pages, "DROP_BYTES", 5 * 11 * pages.FAULT_AROUND_BYTES)
    monkeypatch.setattr(pages, "drop_pages", lambda *arrays: drops.append(len(arrays)))
    write_store(tmp_path / "s", [f"k{i:05d}" for i in range(1000)])
    store = CaptionStore.open(tmp_path / "s")
    drops.clear()  # the open's
    for i in range(14):
        store.find([f"k{i:05d}"])
    assert drops == [2, 2]  # after the 5th and the 10th key: keys and rows
    store.find([f"k{i:05d}" for i in range(12)])
    assert drops == [2, 2, 2] and store.looked_up == 0


def test_an_empty_store_finds_nothing(tmp_path):
    write_store(tmp_path / "s", [])
    rows, found = CaptionStore.open(tmp_path / "s").find(["a", "b"])
    assert rows.tolist() == [-1, -1] and found.tolist() == [False, False]
