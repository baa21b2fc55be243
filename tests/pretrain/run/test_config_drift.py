"""Configuration drift: a key another version of the code added or removed is listed,
never refused; a trained key changed from or to null is a change like any other."""

from __future__ import annotations

from pathlib import Path

import pytest

from core.errors import RunError
from pretrain.run.config_drift import ABSENT, check_drift, config_changes

RECORDED = "model:\n  width: 64\nobjective:\n  num_negatives: null\n"


def test_a_key_the_checkpoint_lacks_is_listed_not_refused():
    current = "model:\n  width: 64\n  image_size: 32\nobjective:\n  num_negatives: null\n"
    assert config_changes(RECORDED, current) == {"model.image_size": (ABSENT, 32)}
    check_drift(Path("ckpt"), RECORDED, current, [])  # goes on
    gone = "model: {}\nobjective:\n  num_negatives: null\n"
    assert config_changes(RECORDED, gone) == {"model.width": (64, ABSENT)}
    check_drift(Path("ckpt"), RECORDED, gone, [])


def test_a_trained_key_changed_from_null_is_refused():
    current = "model:\n  width: 64\nobjective:\n  num_negatives: 64\n"
    assert config_changes(RECORDED, current) == {"objective.num_negatives": (None, 64)}
    with pytest.raises(RunError, match="objective.num_negatives=None in the checkpoint, 64 "
                                       "here"):
        check_drift(Path("ckpt"), RECORDED, current, [])
    check_drift(Path("ckpt"), RECORDED, current, ["objective.num_negatives"])


def test_layer_decay_shapes_the_optimizer_and_is_refused_the_learning_rate_is_not():
    recorded = "optim:\n  lr: 0.1\n  layer_decay: 0.75\n"
    with pytest.raises(RunError, match="optim.layer_decay=0.75 in the checkpoint, 1.0 here"):
        check_drift(Path("ckpt"), recorded, "optim:\n  lr: 0.1\n  layer_decay: 1.0\n", [])
    check_drift(Path("ckpt"), recorded, "optim:\n  lr: 0.2\n  layer_decay: 0.75\n", [])
