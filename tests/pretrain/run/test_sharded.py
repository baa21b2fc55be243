"""Sharded (DCP) checkpoint state in one process: written and read back exactly, read
whole by name, and a ``.metadata`` pickle that names anything but DCP's own records is
refused before it can run."""

from __future__ import annotations

import os
import pickle

import pytest
import torch

from pretrain.run.sharded import load_sharded, read_whole, save_sharded


def small_run(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3),
                                torch.nn.Linear(3, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def test_a_sharded_state_reads_back_exactly_and_whole(tmp_path):
    model, optimizer = small_run(0)
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    save_sharded(model, optimizer, tmp_path / "state")
    other, other_optimizer = small_run(1)
    load_sharded(other, other_optimizer, tmp_path / "state")
    for key, value in model.state_dict().items():
        assert torch.equal(other.state_dict()[key], value), key
    moments = read_whole(tmp_path / "state", "optimizer.state.")
    assert torch.equal(moments["0.weight.exp_avg"], optimizer.state[model[0].weight]["exp_avg"])
    whole = read_whole(tmp_path / "state", "model.")
    assert whole.keys() == model.state_dict().keys()


class Command:
    def __reduce__(self):
        return (os.system, (f"touch {self.mark}",))


def test_metadata_that_would_run_a_command_is_refused(tmp_path):
    model, optimizer = small_run(0)
    save_sharded(model, optimizer, tmp_path / "state")
    command = Command()
    command.mark = tmp_path / "ran"
    (tmp_path / "state" / ".metadata").write_bytes(pickle.dumps(command))
    with pytest.raises(pickle.UnpicklingError, match="names posix.system, which a DCP "
                                                     "checkpoint does not hold: refused"):
        read_whole(tmp_path / "state", "model.")
    assert not (tmp_path / "ran").exists()
