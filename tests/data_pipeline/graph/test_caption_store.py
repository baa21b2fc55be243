"""The caption job: one row per distinct caption, 2 parts equal 1, kill and restart equals
an uninterrupted run, the loader joins the right row, bad input is counted or refused."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter

import numpy as np
import pytest
import torch

from data_pipeline.config import DataConfig
from data_pipeline.formats import Sample
from data_pipeline.graph import parts as part_files
from data_pipeline.graph.config import GraphConfig
from data_pipeline.graph.encoder import encode, load_encoder
from data_pipeline.graph.job import (
    caption_batches,
    collect,
    encode_part,
    merge,
    run_captions,
)
from data_pipeline.graph.neighbours import build_neighbours, describe
from data_pipeline.graph.store import CaptionStore, StoreError
from data_pipeline.loader import LoaderState, eval_batches, train_batches
from tests import prewarmed
from tests.data_pipeline.helpers import digit_sample, write_set
from tests.data_pipeline.remote import ShardServer

NAMES = ["tabby cat", "golden retriever", "violin", "soccer ball", "cello", "banjo", "pug"]



def lookup(store: CaptionStore, keys: list[str]) -> np.ndarray:
    """[n, E] float16 embeddings of ``keys``, every one of which must be in the store."""
    rows, found = store.find(keys)
    assert found.all(), [k for k, f in zip(keys, found, strict=True) if not f]
    return np.asarray(store.embeddings[rows])

def caption_set(directory, distinct: int = 40, repeats: int = 3):
    """Shards whose captions repeat, plus an empty, a whitespace and a very long caption."""
    captions = [f"a photo of a {NAMES[i % 7]} number {i}" for i in range(distinct)]
    samples = [digit_sample(i, key=f"k{i:04d}", caption=captions[i % distinct])
               for i in range(distinct * repeats)]
    samples += [digit_sample(0, key="empty", caption=""),
                digit_sample(1, key="blank", caption="   "),
                digit_sample(2, key="long", caption="word " * 400)]
    write_set(directory, [samples[i::3] for i in range(3)])
    return captions


# One float16 step just below 1: the largest rounding difference a component of a unit
# vector can show when the float32 arithmetic under it rounds differently
FLOAT16_STEP = 2.0**-11


def assert_same_store(got, want) -> None:
    """The promise of ``docs/graph.md``: keys, rows and captions byte for byte (they come
    from sorting and counting, whatever the parts); embeddings within one float16 step.
    Each caption is encoded in the same batch however the work is split, but the float32
    arithmetic of that batch may round differently in another process (another thread
    count, another memory alignment) or on another CPU, and a last-bit difference can
    turn into a different float16."""
    for name in ("keys.npy", "rows.npy", "captions.jsonl"):
        assert (got / name).read_bytes() == (want / name).read_bytes(), name
    a, b = (np.load(d / "embeddings.npy") for d in (got, want))
    assert a.dtype == b.dtype == np.float16 and a.shape == b.shape
    np.testing.assert_allclose(a.astype(np.float32), b.astype(np.float32), rtol=0,
                               atol=FLOAT16_STEP)


def test_duplicates_share_a_row_and_bad_captions_are_counted(tmp_path):
    captions = caption_set(tmp_path / "shards")
    store = run_captions(GraphConfig(shards=str(tmp_path / "shards"),
                                     output=str(tmp_path / "store"), batch_size=16))
    assert store.meta["num_keys"] == 121 and store.meta["num_unique"] == 41
    assert store.meta["skipped"] == {"empty_caption": 2}  # "" is written as no caption at all
    assert store.meta["truncated"] == 1
    rows, found = store.find(["k0003", "k0043", "k0083", "k0004", "nope"])
    assert list(found) == [True, True, True, True, False]
    assert rows[0] == rows[1] == rows[2] != rows[3]
    model = load_encoder("bundled")
    fresh, _ = encode(model, [captions[3]], 8)
    cos = float(lookup(store, ["k0043"]).astype(np.float32)[0] @ fresh[0].astype(np.float32))
    assert cos > 0.999


def test_a_centred_store_holds_unit_captions_less_the_samples_mean(tmp_path):
    """graph.center: every row is unit(unit(e) - m), m the mean over the samples (a caption
    counted as often as samples carry it, not once), against a float64 reference from the
    uncentred store; two parts equal one."""
    repeats = [1 + 5 * (i % 4 == 0) for i in range(20)]  # some captions 6 times, some once
    captions = [f"a photo of a {NAMES[i % 7]}, picture {i}" for i in range(20)]
    samples = [digit_sample(j, key=f"k{i:02d}-{r}", caption=captions[i])
               for j, (i, r) in enumerate((i, r) for i in range(20) for r in range(repeats[i]))]
    write_set(tmp_path / "shards", [samples[i::2] for i in range(2)])
    keys = [s.key for s in samples]
    shards = str(tmp_path / "shards")
    plain = run_captions(GraphConfig(shards=shards, output=str(tmp_path / "plain"),
                                     batch_size=8))
    units = lookup(plain, keys).astype(np.float64)
    units /= np.linalg.norm(units, axis=1, keepdims=True)
    centred = units - units.mean(0)  # over samples: duplicates weigh as often as they occur
    want = centred / np.linalg.norm(centred, axis=1, keepdims=True)
    store = run_captions(GraphConfig(shards=shards, output=str(tmp_path / "centred"),
                                     batch_size=8, center=True))
    assert store.meta["center"] is True and plain.meta["center"] is False
    got = lookup(store, keys).astype(np.float64)
    # float16 rows: the plain store's rounding, carried through the centring, and the
    # centred store's own; both below 2 float16 steps of a unit vector's components
    np.testing.assert_allclose(got, want, rtol=0, atol=2 * FLOAT16_STEP)
    distinct = np.unique(units, axis=0)  # the fault this data would show: each caption once
    assert len(distinct) == 20
    wrong = units - distinct.mean(0)
    wrong /= np.linalg.norm(wrong, axis=1, keepdims=True)
    assert np.abs(wrong - want).max() > 10 * FLOAT16_STEP, "the weighting is not tested"
    in_two_parts(GraphConfig(shards=shards, output=str(tmp_path / "two"), batch_size=8,
                             num_parts=2, center=True))
    assert_same_store(tmp_path / "two", tmp_path / "centred")


def test_every_caption_is_encoded_in_the_same_batch_however_the_work_is_split(tmp_path):
    caption_set(tmp_path / "shards")
    batches = {}
    for parts in (1, 2, 7):
        cfg = GraphConfig(shards=str(tmp_path / "shards"), output=str(tmp_path / f"p{parts}"),
                          batch_size=8, num_parts=parts)
        for part in range(parts):
            collect(cfg, part, parts)
        batches[parts] = list(caption_batches(cfg, parts))
    assert len(batches[1]) == 6 and all(len(b) == 8 for b in batches[1][:-1])
    assert batches[1] == batches[2] == batches[7]


def test_two_parts_equal_one(tmp_path):
    caption_set(tmp_path / "shards")
    one = GraphConfig(shards=str(tmp_path / "shards"), output=str(tmp_path / "one"),
                      batch_size=8)
    run_captions(one)
    in_two_parts(GraphConfig(shards=str(tmp_path / "shards"), output=str(tmp_path / "two"),
                             batch_size=8, num_parts=2))
    assert_same_store(tmp_path / "one", tmp_path / "two")


def in_two_parts(two: GraphConfig) -> None:
    """The caption job as two slurm parts would run it, the second part encoding first."""
    for part in (0, 1):
        collect(two, part, 2)
    for part in (1, 0):
        encode_part(two, part, 2)
    merge(two, 2)


@pytest.mark.parametrize("block", [None, 4])
def test_streamed_merge_of_seven_parts_equals_an_in_memory_reference(tmp_path, monkeypatch,
                                                                    block):
    """Seven parts over five shards (two parts empty), captions whose code-point order
    differs from their UTF-8 byte order and keys of several lengths: the store equals the
    in-memory reference (every key sorted, every caption sorted and deduplicated). With
    ``block`` the merge buffers that many values over all parts (one per part here), so
    every part's reads and writes cross block boundaries."""
    if block is not None:
        monkeypatch.setattr(part_files, "BLOCK", block)
        monkeypatch.setattr(part_files, "MIN_PART_BLOCK", 1)
        assert part_files.part_block(7) == 1
    odd = ["\ufb01ne", "\U0001f600 smile", "z end", "é", "a \"quoted\", comma",
           "two\nlines", "a photo", "ascii"]
    samples = [digit_sample(i, key=f"k{i * 37 % 101}" + "x" * (i % 4), caption=odd[i % 8])
               for i in range(45)]
    write_set(tmp_path / "shards", [samples[i::5] for i in range(5)])
    cfg = GraphConfig(shards=str(tmp_path / "shards"), output=str(tmp_path / "seven"),
                      batch_size=3, num_parts=7)
    for part in range(7):
        collect(cfg, part, 7)
    for part in reversed(range(7)):
        encode_part(cfg, part, 7)
    store = merge(cfg, 7)
    distinct = sorted(set(odd))
    reference = sorted((s.key.encode(), distinct.index(s.caption)) for s in samples)
    assert store.keys.tolist() == [k for k, _ in reference]
    assert store.rows.tolist() == [r for _, r in reference]
    assert store.captions() == distinct
    one = run_captions(GraphConfig(shards=str(tmp_path / "shards"),
                                   output=str(tmp_path / "one"), batch_size=3))
    assert_same_store(tmp_path / "one", tmp_path / "seven")
    fresh, _ = encode(load_encoder("bundled"), distinct, 8)
    cosines = (np.asarray(one.embeddings, np.float32) * fresh.astype(np.float32)).sum(1)
    assert cosines.min() > 0.999


def test_a_key_in_two_parts_fails_naming_it(tmp_path):
    write_set(tmp_path / "shards", [[digit_sample(0, key="same", caption="one")],
                                    [digit_sample(1, key="same", caption="two")]])
    cfg = GraphConfig(shards=str(tmp_path / "shards"), output=str(tmp_path / "s"),
                      num_parts=2)
    for part in (0, 1):
        collect(cfg, part, 2)
    for part in (0, 1):
        encode_part(cfg, part, 2)
    with pytest.raises(ValueError, match="key same occurs twice"):
        merge(cfg, 2)


def test_shards_served_over_http_give_the_same_store(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    caption_set(tmp_path / "shards")
    (tmp_path / "shards" / "manifest.json").unlink()  # a plain URL list: counted once
    server = ShardServer(tmp_path / "shards").start()
    try:
        run_captions(GraphConfig(shards=f"{server.url}/shard-{{000000..000002}}.tar",
                                 output=str(tmp_path / "remote"), batch_size=8))
    finally:
        server.stop()
    run_captions(GraphConfig(shards=str(tmp_path / "shards" / "shard-{000000..000002}.tar"),
                             output=str(tmp_path / "local"), batch_size=8))
    assert_same_store(tmp_path / "remote", tmp_path / "local")


def test_encode_refuses_to_start_before_every_part_is_collected(tmp_path):
    caption_set(tmp_path / "shards")
    cfg = GraphConfig(shards=str(tmp_path / "shards"), output=str(tmp_path / "s"), num_parts=2)
    collect(cfg, 0, 2)
    with pytest.raises(RuntimeError, match="collect part 1 of 2 is not finished"):
        encode_part(cfg, 0, 2)


def test_ranks_meet_through_files_and_a_late_rank_is_waited_for(tmp_path):
    """Two torchrun-style ranks (RANK/WORLD_SIZE) as real processes, the second started 5 s
    after the first: rank 0 waits for its collect part, both encode, rank 0 merges; no
    process group is made, so nothing can time out. The store equals one part's."""
    caption_set(tmp_path / "shards")
    run_captions(GraphConfig(shards=str(tmp_path / "shards"), output=str(tmp_path / "one"),
                             batch_size=8))
    args = [sys.executable, "-m", "app.graph_precompute", f"graph.shards={tmp_path / 'shards'}",
            f"graph.output={tmp_path / 'ranks'}", "graph.batch_size=8"]
    env = os.environ | {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "WORLD_SIZE": "2"}
    first = subprocess.Popen(args, env=env | {"RANK": "0"}, stderr=subprocess.PIPE, text=True)
    time.sleep(5)
    second = subprocess.run(args, env=env | {"RANK": "1"}, capture_output=True, text=True)
    _, err = first.communicate(timeout=300)
    assert second.returncode == 0 and first.returncode == 0, err + second.stderr
    assert_same_store(tmp_path / "one", tmp_path / "ranks")


def test_killed_job_restarts_and_equals_an_uninterrupted_run(tmp_path):
    caption_set(tmp_path / "shards", distinct=160, repeats=1)
    run_captions(GraphConfig(shards=str(tmp_path / "shards"), output=str(tmp_path / "whole"),
                             batch_size=4))
    args = [sys.executable, "-m", "app.graph_precompute",
            f"graph.shards={tmp_path / 'shards'}", f"graph.output={tmp_path / 'killed'}",
            "graph.batch_size=4"]
    env = os.environ | {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    chunks = tmp_path / "killed" / "chunks"
    deadline = time.time() + 120
    while time.time() < deadline and len(list(chunks.glob("chunk-*.json"))) < 3:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    finished = len(list(chunks.glob("chunk-*.json")))
    assert 3 <= finished < 41, "the job was not interrupted mid-encode"
    assert not (tmp_path / "killed" / "meta.json").exists()
    # the restart forked from a pre-imported interpreter (``tests/prewarmed.py``): the killed
    # run above started a fresh one
    rerun = prewarmed.run_module("app.graph_precompute", args[3:], env, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    assert_same_store(tmp_path / "whole", tmp_path / "killed")


def test_loader_joins_each_key_to_its_row_and_counts_missing_ones(tmp_path):
    caption_set(tmp_path / "shards", distinct=20, repeats=2)
    store = run_captions(GraphConfig(shards=str(tmp_path / "shards"),
                                     output=str(tmp_path / "store"), batch_size=16))
    # shards with two extra samples that the store has never seen
    extra = [Sample(f"new{i}", digit_sample(i).image, "jpg", 1, "an unseen caption")
             for i in range(2)]
    write_set(tmp_path / "more", [[digit_sample(i, key=f"k{i:04d}",
                                                caption=f"c{i}") for i in range(30)] + extra])
    cfg = DataConfig(shards=str(tmp_path / "more"), caption_store=str(tmp_path / "store"),
                     batch_size=6, workers=2, resolution=16, max_skip_fraction=0.5)
    state = LoaderState()
    for batch in train_batches(cfg, state=state):
        heads = batch["keys"]
        want = torch.from_numpy(lookup(store, heads))
        assert torch.equal(batch["caption_embeddings"][:6], want)
        assert torch.equal(batch["caption_embeddings"][6:], want)
    skipped = Counter()
    keys = [k for b in eval_batches(cfg, skipped=skipped) for k in b["keys"]]
    assert skipped == {"missing_embedding": 2} and len(keys) == 30


def test_store_whose_index_and_rows_disagree_names_the_file(tmp_path):
    caption_set(tmp_path / "shards", distinct=10, repeats=1)
    run_captions(GraphConfig(shards=str(tmp_path / "shards"), output=str(tmp_path / "s")))
    rows = np.load(tmp_path / "s" / "rows.npy")
    np.save(tmp_path / "s" / "rows.npy", rows[:-1])
    with pytest.raises(StoreError, match="rows.npy"):
        CaptionStore.open(tmp_path / "s")
    with pytest.raises(StoreError, match="rows.npy"):
        next(iter(train_batches(DataConfig(shards=str(tmp_path / "shards"),
                                           caption_store=str(tmp_path / "s")))))


def test_a_hostile_meta_json_is_refused_in_one_line_and_read_no_further(tmp_path,
                                                                         monkeypatch):
    """An endless meta.json (a link to /dev/zero), a nested one and a huge one: each fails
    naming the file; a huge one is read no further than 1 MiB."""
    store = tmp_path / "s"
    store.mkdir()
    meta = store / "meta.json"
    meta.symlink_to("/dev/zero")  # not a file: refused before any read
    with pytest.raises(StoreError, match="meta.json: missing"):
        CaptionStore.open(store)
    meta.unlink()
    meta.write_text("[" * 100_000)
    with pytest.raises(StoreError, match="meta.json: not JSON"):
        CaptionStore.open(store)
    meta.write_text(" " * (2 << 20) + "{}")
    asked = []

    class Handle:  # the file as opened, recording how much each read asks for
        def __init__(self, *args, **kwargs) -> None:
            self.handle = open(*args, **kwargs)  # noqa: SIM115

        def __enter__(self) -> Handle:
            return self

        def __exit__(self, *exc) -> None:
            self.handle.close()

        def read(self, size: int = -1) -> bytes:
            asked.append(size)
            return self.handle.read(size)

    monkeypatch.setattr("data_pipeline.graph.store.open", Handle, raising=False)
    with pytest.raises(StoreError, match="meta.json: larger than"):
        CaptionStore.open(store)
    assert asked and all(0 < size <= (1 << 20) + 1 for size in asked), asked


@pytest.mark.parametrize("index", ["exact", "ivf"])
def test_neighbour_graph_and_inspection(tmp_path, index):
    """The inverted file's one list here holds every caption, so it is exact too; its
    memory-mapped scratch folder is gone once the graph is written."""
    caption_set(tmp_path / "shards", distinct=30, repeats=1)
    cfg = GraphConfig(shards=str(tmp_path / "shards"), output=str(tmp_path / "s"), neighbours=4,
                      index=index)
    store = run_captions(cfg)
    before = sorted(p.name for p in (tmp_path / "s").iterdir())
    build_neighbours(cfg)
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == sorted([*before,
                                                                         "neighbours.npz"])
    vectors = np.asarray(store.embeddings, dtype=np.float32)
    with np.load(tmp_path / "s" / "neighbours.npz") as graph:
        ids, sims = graph["ids"], graph["similarities"]
        assert (ids.dtype, sims.dtype) == (np.int32, np.float16)
        assert str(graph["index"]) == index and float(graph["recall"]) == 1.0
    brute = vectors @ vectors.T
    np.fill_diagonal(brute, -np.inf)
    assert (np.sort(ids, 1) == np.sort(np.argsort(-brute, 1)[:, :4], 1)).all()
    np.testing.assert_allclose(sims, -np.sort(-brute, 1)[:, :4], atol=2e-3)
    text = describe(GraphConfig(output=str(tmp_path / "s"), task="show", key="k0007"))
    assert text.splitlines()[0] == "k0007: a photo of a tabby cat number 7"
    assert len(text.splitlines()) == 5


def test_show_without_a_neighbour_graph_says_which_task_to_run(tmp_path, capsys):
    from app.graph_precompute import main

    caption_set(tmp_path / "shards", distinct=5, repeats=1)
    run_captions(GraphConfig(shards=str(tmp_path / "shards"), output=str(tmp_path / "s")))
    for key, expected in (("k0001", f"{tmp_path / 's' / 'neighbours.npz'}: no neighbour graph "
                                    "(run graph-precompute graph.task=neighbours first)"),
                          ("nobody", f"graph.key=nobody: not in the caption store "
                                     f"{tmp_path / 's'}")):
        with pytest.raises(SystemExit) as exit_info:
            main([f"graph.output={tmp_path / 's'}", "graph.task=show", f"graph.key={key}"])
        assert exit_info.value.code == 1
        assert capsys.readouterr().err.strip().splitlines()[-1] == (
            f"graph-precompute: error: {expected}")

