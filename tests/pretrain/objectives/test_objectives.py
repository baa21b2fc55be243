"""The objective registry says what each objective needs, and the objectives agree: the
ones that need labels refuse a batch without them, the others run on it; every declared
hyperparameter is a config key and a keyword of the function."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

from core.config import InvalidValue
from pretrain.contrast.parameters import ParameterShape
from pretrain.objectives import OBJECTIVES, ObjectiveConfig, batch_loss, objective_spec

LABELLED = [name for name, spec in OBJECTIVES.items() if spec.labels]
UNLABELLED = [name for name, spec in OBJECTIVES.items() if not spec.labels]


@pytest.mark.parametrize("name", LABELLED)
def test_objectives_that_need_labels_refuse_a_batch_without_them(batch, name):
    with pytest.raises(ValueError, match=f"{name}: needs class labels"):
        batch_loss(name, batch.z, batch.ids, temperature=0.1)


@pytest.mark.parametrize("name", UNLABELLED)
def test_objectives_that_need_no_labels_run_without_them(batch, name):
    spec = OBJECTIVES[name]
    inputs = {"captions": batch.captions} if spec.soft_targets else {}
    if spec.text_tower:
        inputs["text"] = batch.text
    out = batch_loss(name, batch.z, batch.ids, temperature=0.1, **inputs)
    assert torch.isfinite(out.loss)


def test_the_needs_are_the_documented_ones():
    assert set(LABELLED) == {"supcon", "sincere", "eps_supinfonce", "projnce"}
    assert [n for n, s in OBJECTIVES.items() if s.soft_targets] == ["xclr"]
    assert [n for n, s in OBJECTIVES.items() if s.text_tower] == ["clip", "siglip"]
    assert {n: [p.name for p in s.parameters] for n, s in OBJECTIVES.items()
            if s.parameters} == {"siglip": ["bias"], "projnce": ["class_embeddings"]}
    assert [n for n, s in OBJECTIVES.items() if not s.softmax] == ["siglip"]


@pytest.mark.parametrize("name", list(OBJECTIVES))
def test_an_objective_s_own_keys_are_its_section_and_its_keywords(name):
    """objective.<name>.* is the dataclass the table entry names, a section of
    ObjectiveConfig of that name; its hyperparameters are keys there and keyword-only
    arguments of the function without defaults (the dataclass holds them, once)."""
    spec = objective_spec(name)
    sections = {f.name: f.type for f in dataclasses.fields(ObjectiveConfig)}
    keywords = inspect.signature(spec.fn).parameters
    if spec.config is None:
        assert name not in sections and not spec.hparams
    else:
        assert sections[name] in (spec.config, spec.config.__name__)
        own = {f.name for f in dataclasses.fields(spec.config)}
        assert set(spec.hparams) <= own
    for key in (*spec.hparams, *(p.name for p in spec.parameters)):
        assert keywords[key].kind is inspect.Parameter.KEYWORD_ONLY, key
        assert keywords[key].default is inspect.Parameter.empty or key == "class_embeddings"
    assert set(ObjectiveConfig(name=name).hparams()) == set(spec.hparams)


def test_every_moved_key_names_a_key_of_a_section():
    for old, new in ObjectiveConfig.MOVED.items():
        section, key = new.split(".")
        assert key == old and hasattr(getattr(ObjectiveConfig(), section), key)


def test_loss_parameters_are_made_for_the_run_s_shape_when_used():
    shape = ParameterShape(num_classes=7, dim=16)
    bias = ObjectiveConfig.of("siglip", bias=-3.0).loss_parameters(shape)
    assert list(bias) == ["bias"] and bias["bias"].shape == () and float(bias["bias"]) == -3.0
    assert ObjectiveConfig(name="projnce").loss_parameters(shape) == {}  # centroid: none
    learned = ObjectiveConfig.of("projnce", projection="learned").loss_parameters(shape)
    table = learned["class_embeddings"]
    assert table.shape == (7, 16)
    cosines = torch.nn.functional.normalize(table, dim=1) @ torch.nn.functional.normalize(
        table, dim=1).T
    assert cosines.fill_diagonal_(0).abs().max() < 0.9  # distinct random directions
    with pytest.raises(ValueError, match="no classes"):
        ObjectiveConfig.of("projnce", projection="learned").loss_parameters(
            ParameterShape(0, 16))
    assert ObjectiveConfig(name="infonce").loss_parameters(shape) == {}


def test_ess_control_needs_a_softmax_objective():
    config = ObjectiveConfig(name="siglip")
    config.ess_control.enabled = True
    with pytest.raises(InvalidValue, match="siglip has no softmax"):
        config.validate()


def test_an_unknown_objective_names_the_choices():
    with pytest.raises(ValueError, match="unknown objective 'sigclr'; choose one of infonce"):
        objective_spec("sigclr")
    with pytest.raises(InvalidValue, match="unknown objective 'sigclr'"):
        ObjectiveConfig(name="sigclr").validate()
