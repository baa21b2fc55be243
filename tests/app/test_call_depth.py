"""From the ``pretrain`` command to the softmax: the calls a reader follows from
``app/pretrain.py``'s ``main`` to the ``log_softmax`` of dense SupCon under 2-rank DDP, as
the stack holds them in a real run (``tests/app/stack_probe.py``), torch's own frames left
out; docs/architecture.md, "Writing a loss"."""

from __future__ import annotations

import json
import os

from tests import prewarmed
from tests.app.helpers import train_overrides

MAX_CALLS = 10  # below main
MAX_FILES = 4


def test_the_entry_point_reaches_the_softmax_in_ten_calls_over_four_files(digits_shards,
                                                                          tmp_path):
    out = tmp_path / "stack"
    overrides = train_overrides(digits_shards, tmp_path, **{
        "objective.name": "supcon", "engine.name": "ddp", "train.max_steps": 1})
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "STACK_PROBE_OUT": str(out)}
    result = prewarmed.run_torchrun("tests.app.stack_probe", overrides, 2, env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in (0, 1):
        frames = [tuple(frame) for frame in json.loads(out.with_suffix(f".{rank}").read_text())]
        path = " -> ".join(f"{file}:{function}" for file, function in frames)
        assert frames[0] == ("app/pretrain.py", "main")
        assert ("pretrain/objectives/supcon.py", "supcon") in frames, path
        assert len(frames) - 1 <= MAX_CALLS, f"{len(frames) - 1} calls: {path}"
        assert len({file for file, _ in frames}) <= MAX_FILES, path
