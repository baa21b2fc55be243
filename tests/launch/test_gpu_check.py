"""launch/gpu_check.sh, the check a GPU owner runs: without a CUDA device it says so in
one line and exits 2 (CI has none), and every configuration it trains is one the run
config accepts, so the script cannot rot between GPU runs."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest
import torch

from app import pretrain

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "launch" / "gpu_check.sh"


def pipelines() -> dict[str, list[str]]:
    """{check name: its overrides} of every ``check NAME pipeline ...`` line."""
    text = SCRIPT.read_text().replace("\\\n", " ")
    found = {}
    for name, rest in re.findall(r"^check (\S+) pipeline \S+(.*)$", text, re.MULTILINE):
        found[name] = [word.replace("$repo", str(REPO)) for word in shlex.split(rest)]
    return found


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU answer")
def test_without_a_gpu_it_says_so_in_one_line():
    result = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "gpu_check: torch sees no CUDA device; nothing to check"]


def test_every_configuration_it_trains_is_valid(monkeypatch, capsys):
    """The ``pretrain`` command's ``main`` in this process, with the arguments the script
    passes (the command line in an interpreter of its own: ``tests/app/test_run_config.py``)."""
    monkeypatch.chdir(REPO)
    found = pipelines()
    assert set(found) == {"ddp-nccl-bf16", "deepspeed-zero2", "dali"}
    for name, overrides in found.items():
        with pytest.raises(SystemExit) as stop:
            pretrain.main(["--config", str(REPO / "launch" / "configs" / "demo.yaml"),
                           "train.max_steps=60", "shards.samples=2000", *overrides,
                           "--print-config"])
        assert stop.value.code == 0, (name, capsys.readouterr().err[-2000:])
