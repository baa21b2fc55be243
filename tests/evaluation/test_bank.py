"""The bank on disk read as a tensor of its rows in key order, without keeping the files
mapped; against the rows sorted in memory."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from evaluation.bank import BankWriter, open_bank

WIDTHS = {"backbone": 6, "projector": 3}


def written(directory: Path, world: int, samples: int = 101, seed: int = 0):
    """``samples`` rows in shuffled key order, dealt to ``world`` writers in batches of
    uneven size (a rank may get none); returns the rows sorted by key."""
    gen = np.random.default_rng(seed)
    keys = [f"s{i:05d}" for i in gen.permutation(samples)]
    labels = torch.from_numpy(gen.integers(-1, 5, samples))
    spaces = {s: torch.from_numpy(gen.normal(size=(samples, w))).float()
              for s, w in WIDTHS.items()}
    writers = [BankWriter(directory, rank) for rank in range(world)]
    start, batch = 0, 0
    while start < samples:
        size = int(gen.integers(1, 9))
        rows = slice(start, start + size)
        rank = 0 if world == 3 and batch % 2 else batch % world  # world 3: rank 2 gets none
        writers[rank].add(keys[rows], labels[rows], {s: v[rows] for s, v in spaces.items()})
        start, batch = start + size, batch + 1
    for writer in writers:
        writer.close()
    order = torch.tensor(sorted(range(samples), key=keys.__getitem__))
    return labels[order], {s: v[order] for s, v in spaces.items()}


@pytest.mark.parametrize("world", [1, 2, 3])
def test_the_bank_reads_as_its_rows_in_key_order(tmp_path, world):
    labels, spaces = written(tmp_path, world)
    bank = open_bank(tmp_path, world, WIDTHS, ["a", "b"])
    assert len(bank) == 101 and torch.equal(bank.labels, labels)
    assert bank.class_names == ["a", "b"]
    picks = torch.tensor([100, 0, 7, 7, 55])
    for space, rows in spaces.items():
        files = getattr(bank, space)
        assert files.shape == rows.shape and len(files) == 101
        assert torch.equal(files[:], rows)  # float32 written and read: the same bits
        assert torch.equal(files[13:40], rows[13:40])
        assert torch.equal(files[picks], rows[picks])
        assert torch.equal(files[picks.numpy()], rows[picks])
        assert files[200:].shape == (0, rows.shape[1])
    bank.remove()
    assert not tmp_path.exists()


def test_a_read_leaves_no_file_mapped(tmp_path):
    """Each read maps a file, copies its rows out and unmaps it: the process keeps no
    page of the bank's files however much of them it has read."""
    written(tmp_path, 2, samples=2000)
    bank = open_bank(tmp_path, 2, WIDTHS, [])
    for start in range(0, 2000, 300):
        bank.backbone[start:start + 300]
    bank.projector[torch.randperm(2000)]
    mapped = Path("/proc/self/maps").read_text()
    assert str(tmp_path) not in mapped
