"""Streaming loaders: reproducible order, equal batches per rank, every eval sample once,
bad input skipped and counted exactly, exact resume."""

from __future__ import annotations

import copy
from collections import Counter
from pathlib import Path

import pytest
import torch

from data_pipeline.config import DataConfig
from data_pipeline.formats import Sample
from data_pipeline.loader import LoaderState, TrainLoader, eval_batches, train_batches
from data_pipeline.loader.collate import PieceDrawer
from data_pipeline.manifest import ManifestError
from data_pipeline.samples import SkipLimitExceeded
from data_pipeline.transforms import MEAN, STD
from tests.data_pipeline.helpers import (
    cut_inside_header,
    digit_sample,
    refresh_manifest,
    uneven_set,
    write_set,
)


def config(directory, **kw) -> DataConfig:
    base = {"shards": str(directory), "batch_size": 8, "workers": 2, "resolution": 16,
            "shuffle_buffer": 16, "max_skip_fraction": 0.5}
    return DataConfig(**(base | kw))


def planted_set(directory):
    """4 shards with one bad sample of each kind and a truncated tail; 40 good samples."""
    good = iter(range(1000))

    def ok():
        return digit_sample(next(good))

    bad = [
        Sample("corrupt", b"\xff\xd8\xff\xe0 broken jpeg", "jpg", 1, "a caption"),
        Sample("emptycap", digit_sample(0).image, "jpg", 1, "   "),
        Sample("badlabel", digit_sample(0).image, "jpg", 12, "a caption"),
    ]
    shards = [[ok() for _ in range(9)] + [bad[0]], [ok() for _ in range(10)] + [bad[1]],
              [ok() for _ in range(10)] + [bad[2]], [ok() for _ in range(11)]]
    write_set(directory, shards)
    # a non-UTF-8 caption and a sample without image, written by hand into shard 2
    import io
    import tarfile
    path = directory / "shard-000002.tar"
    with tarfile.open(path, "a") as tar:
        for name, data in (("latin1.jpg", digit_sample(0).image), ("latin1.cls", b"1"),
                           ("latin1.txt", "café".encode("latin-1")), ("noimage.cls", b"3")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    # truncate shard 3 inside its last member: its first samples survive
    tail = directory / "shard-000003.tar"
    with tarfile.open(tail) as tar:
        last = tar.getmembers()[-1]
    tail.write_bytes(tail.read_bytes()[: last.offset_data + last.size // 2])
    refresh_manifest(directory)


def test_fixed_seed_gives_the_same_stream_and_another_seed_does_not(tmp_path):
    uneven_set(tmp_path, [30, 20, 14])
    runs = [[(b["keys"], b["images"]) for b in train_batches(config(tmp_path, seed=s))]
            for s in (0, 0, 1)]
    assert [k for k, _ in runs[0]] == [k for k, _ in runs[1]]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(runs[0], runs[1], strict=True))
    assert [k for k, _ in runs[0]] != [k for k, _ in runs[2]]


def test_batch_layout(tmp_path):
    uneven_set(tmp_path, [20, 20])
    batch = next(iter(train_batches(config(tmp_path, workers=0))))
    assert batch["images"].shape == (16, 3, 16, 16)
    assert torch.equal(batch["ids"][:8], batch["ids"][8:])  # the two views share an id
    assert len(set(batch["ids"][:8].tolist())) == 8
    assert torch.equal(batch["labels"][:8], batch["labels"][8:])
    assert not torch.equal(batch["images"][:8], batch["images"][8:])  # views differ
    assert batch["captions"][0].startswith("a photo of the digit")


def test_equal_batch_counts_per_rank_with_odd_uneven_shards(tmp_path):
    uneven_set(tmp_path, [37, 5, 90, 13, 1])  # 146 samples in 5 uneven shards
    counts = [sum(1 for _ in train_batches(config(tmp_path), rank=r, world=3)) for r in range(3)]
    assert counts == [146 // (3 * 8)] * 3


def test_eval_reads_every_sample_exactly_once_over_2_ranks_x_2_workers(tmp_path):
    uneven_set(tmp_path, [13, 7, 21, 2, 9])
    keys = [k for rank in range(2)
            for batch in eval_batches(config(tmp_path, workers=2), rank=rank, world=2)
            for k in batch["keys"]]
    assert len(keys) == 52 and len(set(keys)) == 52


def test_planted_bad_samples_are_counted_exactly_and_the_rest_delivered(tmp_path):
    planted_set(tmp_path)
    skipped = Counter()
    keys = [k for b in eval_batches(config(tmp_path, workers=2), skipped=skipped)
            for k in b["keys"]]
    assert dict(skipped) == {"corrupt_image": 1, "bad_caption": 2, "bad_label": 1,
                             "missing_image": 1, "truncated_shard": 1}
    assert len(keys) == len(set(keys)) == 39  # 40 good, the truncated tail lost one
    state = LoaderState()
    for _ in train_batches(config(tmp_path, workers=0, shuffle_buffer=4), state=state):
        pass
    assert set(state.skipped) <= {"corrupt_image", "bad_caption", "bad_label",
                                  "missing_image", "truncated_shard"}
    assert sum(state.skipped.values()) > 0


def test_a_tar_cut_inside_a_header_reports_the_shortfall_naming_the_shard(tmp_path):
    write_set(tmp_path, [[digit_sample(i) for i in range(300)]])
    cut_inside_header(tmp_path / "shard-000000.tar", "s00180.cls")  # its first member
    refresh_manifest(tmp_path)  # the manifest agrees with the cut file's size
    skipped = Counter()
    keys = [k for b in eval_batches(config(tmp_path, max_skip_fraction=1.0), skipped=skipped)
            for k in b["keys"]]
    assert len(keys) == 180 and dict(skipped) == {"truncated_shard": 120}
    state = LoaderState()
    for _ in train_batches(config(tmp_path, workers=0, max_skip_fraction=1.0), state=state):
        pass
    # every position of the epoch once: the 120 lost ones but the 300 % 8 left undealt
    assert state.skipped == {"truncated_shard": 120 - 300 % 8}
    assert "truncated_shard shard-000000.tar" in state.summary()
    assert "180 of the manifest's 300 samples read" in state.summary()


def test_member_names_that_look_like_paths_are_skipped_and_nothing_is_written(tmp_path):
    import io
    import tarfile

    write_set(tmp_path / "set", [[digit_sample(i) for i in range(30)]])
    path = tmp_path / "set" / "shard-000000.tar"
    with tarfile.open(path, "a") as tar:
        for name in ("../escape.jpg", "../escape.cls", "/absolute.jpg", "a/../b.jpg"):
            data = digit_sample(0).image if name.endswith(".jpg") else b"1"
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    refresh_manifest(tmp_path / "set")
    skipped = Counter()
    keys = [k for b in eval_batches(config(tmp_path / "set"), skipped=skipped)
            for k in b["keys"]]
    assert len(keys) == 30 and dict(skipped) == {"unsafe_name": 3}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["set"]  # nothing extracted
    assert not Path("/absolute.jpg").exists()


def test_too_many_bad_samples_abort_naming_the_shard(tmp_path):
    planted_set(tmp_path)
    with pytest.raises(SkipLimitExceeded, match=r"shard-00000\d\.tar"):
        list(eval_batches(config(tmp_path, workers=0, max_skip_fraction=0.01)))


def test_manifest_that_does_not_match_fails_before_reading(tmp_path):
    uneven_set(tmp_path, [10, 10])
    (tmp_path / "shard-000001.tar").write_bytes(b"")
    with pytest.raises(ManifestError, match="shard-000001.tar"):
        next(iter(train_batches(config(tmp_path))))


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_continues_exactly_where_the_run_stopped(tmp_path, workers):
    planted_set(tmp_path)  # skips must be counted once, in the batch that holds them
    cfg = config(tmp_path, workers=workers, batch_size=4, shuffle_buffer=8)
    state = LoaderState()
    full, snapshots = [], []
    for batch in train_batches(cfg, state=state):
        full.append(batch)
        snapshots.append(LoaderState.from_state_dict(
            {k: (list(v) if isinstance(v, list) else dict(v) if isinstance(v, dict) else v)
             for k, v in state.state_dict().items()}))
    assert state.epoch == 1 and state.batches == 0
    stop = 5
    resumed = list(train_batches(cfg, state=snapshots[stop - 1]))
    assert len(resumed) == len(full) - stop
    for got, want in zip(resumed, full[stop:], strict=True):
        assert got["keys"] == want["keys"] and got["skipped"] == want["skipped"]
        assert torch.equal(got["images"], want["images"])


def keys_of(cfg, world: int, state=None) -> list[list[str]]:
    """Every key each rank's stream delivers, in order (whole epochs from ``state``)."""
    return [[k for b in train_batches(cfg, rank, world, copy.deepcopy(state)) for k in b["keys"]]
            for rank in range(world)]


def test_an_epoch_of_real_shards_reads_every_sample_once_over_3_ranks_x_2_workers(tmp_path):
    uneven_set(tmp_path, [37, 5, 90, 13, 1])  # 146 samples: fewer shards than the 6 streams
    per_rank = keys_of(config(tmp_path, batch_size=4), world=3)
    keys = [k for rank in per_rank for k in rank]
    assert [len(r) for r in per_rank] == [146 // 12 * 4] * 3
    assert len(set(keys)) == len(keys) == 146 // 12 * 12


def test_a_resume_on_another_number_of_ranks_loses_and_repeats_nothing(tmp_path):
    uneven_set(tmp_path, [37, 25, 90, 13, 31])  # 196 samples
    cfg = config(tmp_path, batch_size=4)
    states, before = [LoaderState() for _ in range(2)], []
    for rank in range(2):  # 2 ranks deliver 7 batches each, then stop
        for i, batch in enumerate(train_batches(cfg, rank, 2, states[rank])):
            before += batch["keys"]
            if i == 6:
                break
    assert states[0].batches == states[1].batches == 7
    after = [k for rank in keys_of(config(tmp_path, batch_size=3, workers=1), 3, states[0])
             for k in rank]
    seen = before + after
    assert len(seen) == len(set(seen))  # nothing twice
    assert 196 - len(seen) < 3 * 3  # nothing lost but less than a global batch


def global_batches(cfg: DataConfig, world: int, state: LoaderState | None = None,
                   ) -> list[tuple[list[str], torch.Tensor, torch.Tensor]]:
    """Each global batch of ``world`` ranks (a global batch of 24 instances) from
    ``state`` on: its keys, first views and second views, the ranks' in rank order."""
    ranks = [list(TrainLoader(cfg, rank, world, copy.deepcopy(state), global_batch=24).epoch())
             for rank in range(world)]
    out = []
    for parts in zip(*ranks, strict=True):
        sizes = [len(part["keys"]) for part in parts]
        out.append(([k for part in parts for k in part["keys"]],
                     torch.cat([p["images"][:n] for p, n in zip(parts, sizes, strict=True)]),
                     torch.cat([p["images"][n:] for p, n in zip(parts, sizes, strict=True)])))
    return out


@pytest.mark.parametrize("pairing", ["views", "same_label"])
def test_global_batches_are_the_same_on_any_world_and_any_workers(tmp_path, pairing):
    """A global batch of 24 instances in chunks of 8: its instances in order and their
    views, bit for bit, on 1, 2 and 3 ranks with 0 to 3 loader workers each, from the
    epoch's start and from a resume after 2 batches (each view is drawn under its sample's
    own seed, from uint8 pixels)."""
    uneven_set(tmp_path, [60, 20, 14, 33, 50])

    def cfg(workers: int) -> DataConfig:
        return config(tmp_path, batch_size=8, workers=workers, pairing=pairing,
                      persistent_workers=False)

    reference = global_batches(cfg(0), 1)
    assert len(reference) >= 3 and len({k for keys, _, _ in reference for k in keys}) == \
        sum(len(keys) for keys, _, _ in reference)
    state, loader = LoaderState(), TrainLoader(cfg(0), 0, 1, global_batch=24)
    for index, _ in enumerate(loader.epoch()):
        if index == 1:
            saved = loader.state_dict()
            break
    state = LoaderState.from_state_dict(saved)
    assert state.batches == 2
    runs = [(world, workers, None) for world, workers in [(1, 2), (2, 1), (3, 3)]]
    runs += [(world, workers, state) for world, workers in [(3, 0), (2, 2)]]
    for world, workers, start in runs:
        got = global_batches(cfg(workers), world, start)
        want = reference if start is None else reference[2:]
        assert len(got) == len(want), (world, workers)
        for (keys, first, second), (keys_, first_, second_) in zip(got, want, strict=True):
            assert keys == keys_, (world, workers, start)
            assert torch.equal(first, first_) and torch.equal(second, second_)


def test_same_label_pairs_are_two_images_of_one_class(tmp_path):
    uneven_set(tmp_path, [40, 40])
    batch = next(iter(train_batches(config(tmp_path, pairing="same_label", workers=0))))
    n = len(batch["keys"])  # the pairs found among the batch's 16 samples of 10 classes
    assert 1 <= n <= 8 and batch["images"].shape[0] == 2 * n
    for key, a, b in zip(batch["keys"], batch["labels"][:n], batch["labels"][n:], strict=True):
        first, second = key.split("+")
        assert first != second and a == b
    images = [k for key in batch["keys"] for k in key.split("+")]
    assert len(set(images)) == 2 * n  # no image in two pairs
    assert not torch.equal(batch["images"][:n], batch["images"][n:])


def test_asymmetric_views_turn_only_the_second_view_grayscale():
    """``grayscale_second``: every second view grayscale (its three channels equal once the
    normalisation is undone), no first view; null draws what the shared recipe draws."""
    gen = torch.Generator().manual_seed(0)
    images = [torch.randint(0, 256, (3, 24, 24), generator=gen, dtype=torch.uint8)
              for _ in range(6)]

    def views(**kw: object) -> torch.Tensor:
        return PieceDrawer(DataConfig(resolution=16, **kw), epoch=0).render(images,
                                                                           list(range(6)))

    pixels = views(grayscale=0.0, grayscale_second=1.0) * torch.tensor(STD).view(3, 1, 1)
    pixels += torch.tensor(MEAN).view(3, 1, 1)
    spread = (pixels.amax(1) - pixels.amin(1)).flatten(1).amax(1)  # per view
    assert (spread[6:] < 1e-5).all() and (spread[:6] > 0.1).all()
    assert torch.equal(views(grayscale=0.5), views(grayscale=0.5, grayscale_second=0.5))


def test_loader_options_prefetch_and_pin_only_for_a_gpu():
    from data_pipeline.loader import loader_options
    from data_pipeline.loader.epochs import ignore_scheduler_signals

    options = loader_options(DataConfig(shards="x", workers=3, prefetch=4))
    assert options == {"num_workers": 3, "prefetch_factor": 4,
                       "pin_memory": torch.cuda.is_available(),
                       "worker_init_fn": ignore_scheduler_signals}
    assert loader_options(DataConfig(shards="x", workers=0)) == {
        "num_workers": 0, "pin_memory": torch.cuda.is_available()}  # no workers, no prefetch
    assert loader_options(DataConfig(shards="x", pin_memory=False))["pin_memory"] is False


def test_loader_workers_outlive_a_sigterm_to_their_process_group():
    """torchrun and slurm signal the whole group; a worker must not die under a trainer
    that is writing its checkpoint (it ends with its parent)."""
    import subprocess
    import sys

    code = ("import os, signal\n"
            "from data_pipeline.loader.epochs import ignore_scheduler_signals\n"
            "ignore_scheduler_signals(0)\n"
            "for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):\n"
            "    os.kill(os.getpid(), sig)\n"
            "print('alive')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "alive", done.stderr
