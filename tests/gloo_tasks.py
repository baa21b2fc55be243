"""Tasks for ``tests/test_gloo_group.py`` (importable, so the spawned ranks can load them)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def rank_one_fails_before_the_all_reduce() -> float:
    """Rank 1 raises; rank 0 waits in an all-reduce that rank 1 never joins."""
    if dist.get_rank() == 1:
        raise ValueError("planted failure on rank 1")
    total = torch.ones(1)
    dist.all_reduce(total)
    return float(total)


def rank_one_dies_before_the_all_reduce() -> float:
    if dist.get_rank() == 1:
        os._exit(3)
    total = torch.ones(1)
    dist.all_reduce(total)
    return float(total)


def all_reduce_of_ones() -> float:
    total = torch.ones(1)
    dist.all_reduce(total)
    return float(total)
