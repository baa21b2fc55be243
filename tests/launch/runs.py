"""What a run left behind, read for comparison with another run: its metric rows by step,
each step's samples from its ledger, and its final weights."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from data_pipeline.loader.ledger import committed_steps, read_attempts
from tests.pretrain.run.test_checkpoint import final_model


def step_rows(log: str) -> dict[int, list[dict[str, float]]]:
    """Rank 0's metric rows by step (a step trained again after a resume has two)."""
    rows: dict[int, list[dict[str, float]]] = {}
    for line in log.splitlines():
        found = re.search(r"rank0 pretrain\.loop\.trainer INFO: step (\d+) (.*=.*)$", line)
        if found:
            row = dict(item.split("=") for item in found.group(2).split())
            rows.setdefault(int(found.group(1)), []).append(
                {k: float(v) for k, v in row.items()})
    return rows


def steps_keys(run: Path) -> dict[int, list[str]]:
    """The samples each committed step trained on, over all ranks, from the ledger."""
    keys: dict[int, list[str]] = {}
    for line in committed_steps(read_attempts(run)):
        keys.setdefault(line["step"], []).extend(line["keys"])
    return {step: sorted(found) for step, found in keys.items()}


def relative_distance(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / a.norm().clamp_min(1e-300))


def assert_same_run(reference: Path, run: Path, steps: int) -> None:
    """``run`` ended where ``reference`` did: the final weights and batch-norm statistics
    to 1e-9 relative (float64 runs), each step's logged loss (steps trained again after a
    resume included), and each step's samples in the ledger."""
    a, b = final_model(reference), final_model(run)
    assert a["step"] == b["step"] == steps
    for key, value in a["model"].items():
        if value.is_floating_point():
            assert value.dtype == torch.float64, key
            assert relative_distance(value, b["model"][key]) < 1e-9, key
        else:
            assert torch.equal(value, b["model"][key]), key
    expected = step_rows((reference / "train.log").read_text())
    found = step_rows((run / "train.log").read_text())
    assert sorted(found) == sorted(expected) == list(range(1, steps + 1))
    for step, rows in found.items():
        for row in rows:
            assert row["loss"] == expected[step][0]["loss"], (step, row, expected[step])
    assert steps_keys(run) == steps_keys(reference)
