"""The epoch ledger (``data_pipeline/loader/ledger.py``) written and read back: attempts
that supersede each other's steps after a resume, a tail after the last checkpoint that is
not committed, dropped updates, skipped samples, a torn last line, and the command's JSON
and table. A whole run under torchrun with a killed worker is in
``tests/pretrain/run/test_checkpoint.py``."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import torch

from data_pipeline.loader.ledger import (
    LEDGER_DIR,
    EpochCount,
    LedgerWriter,
    epoch_counts,
    main,
)
from tests import prewarmed

TOTAL = 12  # samples of the toy data set: s00..s11, 4 per step of 2 ranks x 2
SHARD_KEYS = [f"s{i:02d}" for i in range(TOTAL)]


def keys(step: int, rank: int) -> list[str]:
    """The toy loader: epoch e's step k (k = 1, 2, 3 within it) reads samples 4(k-1) on."""
    first = 4 * ((step - 1) % 3) + 2 * rank
    return [f"s{first:02d}", f"s{first + 1:02d}"]


def epoch_of(step: int) -> int:
    return (step - 1) // 3


def write_attempt(run_dir: Path, name: str, world: int, resumed_from: int,
                  steps: range, checkpoints: set[int], applied: bool = True) -> None:
    """Every rank of one attempt: its steps, a commit at each step in ``checkpoints``."""
    for rank in range(world):
        ledger = LedgerWriter(run_dir, name, rank, world)
        ledger.start(resumed_from)
        for step in steps:
            batch = {"keys": keys(step, rank) if world == 2 else keys(step, 0) + keys(step, 1)}
            ledger.record(epoch_of(step), step, batch, torch.tensor(applied))
            if step in checkpoints:
                ledger.commit(step)
        ledger.close()


def test_a_resume_supersedes_the_steps_after_its_checkpoint(tmp_path):
    """Attempt 1 (2 ranks) trains steps 1-5, checkpoints at 2 and 4 and is killed after 5;
    attempt 2 (1 rank) resumes from 4 and trains to 6. Step 5 of attempt 1 is superseded:
    every sample of both epochs is counted once."""
    write_attempt(tmp_path, "00000000000001-r000", 2, 0, range(1, 6), {2, 4})
    write_attempt(tmp_path, "00000000000002-r001", 1, 4, range(5, 7), {6})
    assert epoch_counts(tmp_path, SHARD_KEYS) == {0: EpochCount(TOTAL, once=12),
                                             1: EpochCount(TOTAL, once=12)}


def test_steps_after_the_newest_checkpoint_are_not_committed(tmp_path):
    write_attempt(tmp_path, "00000000000001-r000", 2, 0, range(1, 6), {2, 4})
    # step 5 (epoch 1's second) follows the last checkpoint: 4 of epoch 1's samples stand
    assert epoch_counts(tmp_path, SHARD_KEYS) == {0: EpochCount(TOTAL, once=12),
                                             1: EpochCount(TOTAL, once=4, unread=8)}


def test_a_resume_from_an_older_checkpoint_reads_its_steps_again_once(tmp_path):
    """Attempt 2 resumes from step 2 although attempt 1 wrote a checkpoint at 4 (a
    ``checkpoint.resume`` path): steps 3-4 of attempt 1 are superseded, not doubled."""
    write_attempt(tmp_path, "00000000000001-r000", 2, 0, range(1, 5), {2, 4})
    write_attempt(tmp_path, "00000000000002-r000", 2, 2, range(3, 7), {6})
    assert epoch_counts(tmp_path, SHARD_KEYS) == {0: EpochCount(TOTAL, once=12),
                                             1: EpochCount(TOTAL, once=12)}


def test_a_sample_read_twice_in_an_epoch_is_counted(tmp_path):
    """A loader that deals step 1's samples again at step 2 (what the ledger is for)."""
    ledger = LedgerWriter(tmp_path, "00000000000001-r000", 0, 1)
    ledger.start(0)
    for step in (1, 2):
        ledger.record(0, step, {"keys": keys(1, 0)}, torch.tensor(True))
    ledger.commit(2)
    ledger.close()
    assert epoch_counts(tmp_path, SHARD_KEYS) == {0: EpochCount(TOTAL, more_than_once=2,
                                                           unread=10)}


def test_dropped_updates_and_skipped_samples(tmp_path):
    """A step whose update was dropped lists its keys under ``dropped`` (not trained on);
    the loader's skips are counted whatever the update did."""
    ledger = LedgerWriter(tmp_path, "00000000000001-r000", 0, 1)
    ledger.start(0)
    skipped = [(("corrupt_image", "shard-000000.tar", "s05: cannot decode"), 1)]
    ledger.record(0, 1, {"keys": ["s00", "s01"], "skipped_samples": skipped},
                  torch.tensor(True))
    ledger.record(0, 2, {"keys": ["s02", "s03"]}, torch.tensor(False))
    ledger.commit(2)
    ledger.close()
    assert epoch_counts(tmp_path, SHARD_KEYS) == {0: EpochCount(TOTAL, once=2, unread=10,
                                                                skipped=1)}
    lines = [json.loads(t) for t in ledger.path.read_text().splitlines()]
    assert lines[0] == {"resumed_from": 0, "world": 1, "rank": 0}
    assert lines[1] == {"epoch": 0, "step": 1, "world": 1, "rank": 0, "keys": ["s00", "s01"],
                        "skipped": [{"reason": "corrupt_image", "shard": "shard-000000.tar",
                                     "detail": "s05: cannot decode", "count": 1}]}
    assert lines[2]["keys"] == [] and lines[2]["dropped"] == ["s02", "s03"]
    assert lines[3] == {"checkpoint": 2}


def test_lines_wait_for_a_flush_and_a_torn_last_line_is_left_out(tmp_path):
    ledger = LedgerWriter(tmp_path, "00000000000001-r000", 0, 1)
    ledger.start(0)
    ledger.record(0, 1, {"keys": ["s00"]}, torch.tensor(True))
    assert len(ledger.path.read_text().splitlines()) == 1  # buffered: no host read yet
    ledger.commit(1)
    ledger.close()
    with ledger.path.open("a") as file:
        file.write('{"epoch": 0, "step": 2, "wor')  # a process killed mid-write
    assert epoch_counts(tmp_path, SHARD_KEYS) == {0: EpochCount(TOTAL, once=1, unread=11)}


def ledger_command(*args: str) -> subprocess.CompletedProcess:
    """The command forked from a pre-imported interpreter (``tests/prewarmed.py``); in a
    fresh one of its own: ``tests/launch/test_multinode.py``."""
    return prewarmed.run_module("data_pipeline.loader.ledger", list(args), dict(os.environ),
                                timeout=120)


def digits_keys(shards: Path) -> list[str]:
    """The keys of the digits shards as webdataset reads them (independent of the ledger's
    header reader)."""
    import webdataset as wds

    return [sample["__key__"] for tar in sorted(shards.glob("*.tar"))
            for sample in wds.WebDataset(str(tar), shardshuffle=False, empty_check=False)]


def test_the_command_prints_json_and_a_table(tmp_path, digits_shards):
    """Keys read from the shards themselves: 12 of the 360 trained on once, the rest listed
    as unread by key."""
    shard_keys = digits_keys(digits_shards)
    ledger = LedgerWriter(tmp_path, "00000000000001-r000", 0, 1)
    ledger.start(0)
    for step in (1, 2, 3):
        ledger.record(0, step, {"keys": shard_keys[4 * step - 4:4 * step]}, torch.tensor(True))
    ledger.commit(3)
    ledger.close()
    (tmp_path / "config.yaml").write_text(f"data:\n  shards: {digits_shards}\n")
    found = ledger_command(str(tmp_path), "--json", "--keys")
    assert found.returncode == 0, found.stderr
    assert json.loads(found.stdout) == {"epochs": {"0": {
        "total": 360, "once": 12, "more_than_once": 0, "unread": 348, "skipped": 0,
        "unknown": 0, "unknown_examples": [], "unread_keys": sorted(shard_keys[12:]),
        "more_keys": []}}}
    table = ledger_command(str(tmp_path), "--shards", str(digits_shards))
    assert table.stdout.splitlines()[1].split() == ["0", "360", "12", "0", "348", "0", "0"]


def test_a_key_the_shards_do_not_hold_is_reported_with_its_line(tmp_path, digits_shards):
    """A ledger line naming a key absent from the shards (a loader that invents or renames
    samples): counted as unknown, not as trained, named with its file and line; the command
    says so and exits 2."""
    shard_keys = digits_keys(digits_shards)
    ledger = LedgerWriter(tmp_path, "00000000000001-r000", 0, 1)
    ledger.start(0)
    ledger.record(0, 1, {"keys": shard_keys[:3]}, torch.tensor(True))
    ledger.record(0, 2, {"keys": [shard_keys[3], "not-a-sample"]}, torch.tensor(True))
    ledger.commit(2)
    ledger.close()
    counts = epoch_counts(tmp_path, shard_keys)
    assert counts == {0: EpochCount(360, once=4, unread=356, unknown=1, unknown_examples=[
        f"'not-a-sample' ({ledger.path.name} line 3)"])}
    found = ledger_command(str(tmp_path), "--json", "--shards", str(digits_shards))
    assert found.returncode == 2
    assert found.stderr.strip().splitlines()[-1] == (
        f"ledger: epoch 0: 1 reads of keys the shards do not hold, e.g. 'not-a-sample' "
        f"({ledger.path.name} line 3)")


def test_the_header_reader_gives_webdataset_s_keys(digits_shards):
    from data_pipeline.tario import sample_keys

    assert [k for tar in sorted(digits_shards.glob("*.tar")) for k in sample_keys(tar)] \
        == digits_keys(digits_shards)


def test_a_run_without_a_ledger_is_told_in_one_line(tmp_path, capsys):
    assert main([str(tmp_path), "--shards", str(tmp_path)]) == 1
    assert capsys.readouterr().err.strip() == (
        f"ledger: {tmp_path / LEDGER_DIR}: no ledger (train with data.ledger=true)")


def test_counts_spilled_over_many_buckets_equal_counts_in_one(tmp_path, monkeypatch):
    """The reader's tally in buckets (a few keys each, as a CC12M ledger's would be) counts
    what one tally of every key counts: superseded steps, a tail, a sample read twice, and
    with ``keep_keys`` the same unread and repeated keys."""
    import data_pipeline.loader.ledger as ledger

    write_attempt(tmp_path, "00000000000001-r000", 2, 0, range(1, 5), {2, 4})
    write_attempt(tmp_path, "00000000000002-r000", 2, 2, range(3, 9), {7})
    doubled = LedgerWriter(tmp_path, "00000000000003-r000", 0, 1)
    doubled.start(7)
    for step in (8, 9):
        doubled.record(epoch_of(step), step, {"keys": keys(1, 0)}, torch.tensor(True))
    doubled.commit(9)
    doubled.close()
    whole = epoch_counts(tmp_path, SHARD_KEYS)
    whole_keys = epoch_counts(tmp_path, SHARD_KEYS, keep_keys=True)
    monkeypatch.setattr(ledger, "KEYS_IN_MEMORY", 3)
    assert epoch_counts(tmp_path, SHARD_KEYS) == whole
    assert epoch_counts(tmp_path, SHARD_KEYS, keep_keys=True) == whole_keys
    assert whole_keys[2].more_keys == ["s00", "s01"]
    assert whole_keys[2].unread_keys == SHARD_KEYS[4:]
    assert whole == {0: EpochCount(TOTAL, once=12), 1: EpochCount(TOTAL, once=12),
                     2: EpochCount(TOTAL, once=2, more_than_once=2, unread=8)}


def tally_peak_bytes(run_dir: Path, samples: int) -> int:
    """Peak Python and numpy allocations (tracemalloc) of reading back a one-epoch ledger
    of ``samples`` keys, each read once, against as many shard keys."""
    import tracemalloc

    shard_keys = [f"{i:09d}" for i in range(samples)]
    ledger = LedgerWriter(run_dir, "00000000000001-r000", 0, 1)
    ledger.start(0)
    for step in range(samples // 1000):
        ledger.record(0, step + 1, {"keys": shard_keys[step * 1000:(step + 1) * 1000]},
                      torch.tensor(True))
    ledger.commit(samples // 1000)
    ledger.close()
    tracemalloc.start()
    try:
        assert epoch_counts(run_dir, shard_keys) == {0: EpochCount(samples, once=samples)}
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_the_tally_holds_a_few_bytes_a_key(tmp_path):
    """A bucket's keys are held in numpy arrays of their bytes, not as a Python string and
    dictionary entry each: the reader's peak grows by under 64 bytes a key (shard key or
    read) from 50,000 to 150,000 samples. Sets and a Counter of the same keys grew by 213."""
    small = tally_peak_bytes(tmp_path / "small", 50_000)
    large = tally_peak_bytes(tmp_path / "large", 150_000)
    assert (large - small) / (2 * 100_000) < 64


def test_keys_with_nul_tab_newline_or_backslash_are_judged_as_written(tmp_path, monkeypatch):
    """A key is one field whatever it holds: shard keys with a tab, a newline or a
    backslash are read once; reads of ``s00\\x00``, ``s0`` + tab + ``1`` and others the
    shards do not hold are unknown (a NUL is not trimmed, a tab does not cut the key),
    named with their lines, the first 5 an epoch, in one bucket or in many."""
    import data_pipeline.loader.ledger as ledger

    odd = ["s\t1", "s\n2", "s\\3", "s\\t4"]
    shard_keys = SHARD_KEYS + odd
    ghosts = ["s00\x00", "s0\t1", "s\\t1", "s\t", "s11\n", "s00 ", "\x00"]
    writer = LedgerWriter(tmp_path, "00000000000001-r000", 0, 1)
    writer.start(0)
    writer.record(0, 1, {"keys": odd + ghosts[:3]}, torch.tensor(True))
    writer.record(0, 2, {"keys": ghosts[3:] + ghosts[:1]}, torch.tensor(True))
    writer.commit(2)
    writer.close()
    lines = {key: 2 if i < 3 else 3 for i, key in enumerate(ghosts)}
    expected = EpochCount(len(shard_keys), once=4, unread=len(SHARD_KEYS), unknown=8)
    whole = epoch_counts(tmp_path, shard_keys, keep_keys=True)
    assert whole[0].unknown_examples == [f"{key!r} ({writer.path.name} line {lines[key]})"
                                         for key in ghosts[:5]]
    monkeypatch.setattr(ledger, "KEYS_IN_MEMORY", 3)
    for counts in (whole, epoch_counts(tmp_path, shard_keys, keep_keys=True)):
        named = counts[0].unknown_examples
        assert len(named) == 5 and len(set(named)) == 5
        assert set(named) <= {f"{key!r} ({writer.path.name} line {lines[key]})"
                              for key in ghosts}
        assert counts[0].unread_keys == sorted(SHARD_KEYS) and counts[0].more_keys == []
        assert counts == {0: EpochCount(**{**expected.__dict__,
                                           "unknown_examples": named,
                                           "unread_keys": sorted(SHARD_KEYS),
                                           "more_keys": []})}
