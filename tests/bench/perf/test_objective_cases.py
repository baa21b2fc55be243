"""The benchmarks take their objectives from the table: every entry, at its defaults and
under its examples, is a case of ``bench.perf.objectives`` (and so of ``bench.perf.negatives``
and the GPU kit) and has a row in their docs tables, and every entry has a recipe the
learning benchmark trains."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from bench.learning import configs
from bench.perf.negatives_tables import shown_cases
from bench.perf.objectives import objective_cases, objective_of, shown_groups
from pretrain.objectives import OBJECTIVES, ObjectiveSpec, batch_loss
from tests.pretrain.objectives.toy_decoupled import decoupled, plain_decoupled

N, DIM, CLASSES, CAPTION_DIM = 16, 8, 4, 12


def small_inputs() -> tuple:
    gen = torch.Generator().manual_seed(0)
    ids = torch.arange(N // 2).repeat(2)
    names = torch.nn.functional.normalize(torch.randn(CLASSES, CAPTION_DIM, generator=gen), dim=1)
    return (torch.randn(N, DIM, generator=gen, dtype=torch.float64).requires_grad_(), ids,
            ids % CLASSES, torch.randn(N // 2, CAPTION_DIM, generator=gen)[ids].double(),
            (names @ names.T).double(),
            torch.randn(N, DIM, generator=gen, dtype=torch.float64).requires_grad_(),
            torch.randn(CLASSES, DIM, generator=gen, dtype=torch.float64))


def test_every_entry_is_a_case_at_its_defaults_and_under_each_example():
    cases = objective_cases(*small_inputs())
    assert {objective_of(case) for case in cases} == set(OBJECTIVES)
    for name, spec in OBJECTIVES.items():
        sources = 2 if spec.soft_targets else 1
        defaults = spec.defaults()
        settings = 1 + sum(1 for e in spec.examples if e and defaults | dict(e) != defaults)
        assert sum(objective_of(case) == name for case in cases) == sources * settings, name


PEER_ROWS = {"lightly NTXentLoss", "pml SupConLoss", "open_clip SigLipLoss"}


def shown_rows(measured: list[str]) -> dict[str, list[str]]:
    """Each docs table's rows over the cases ``measured``: words -> the cases they show."""
    return {"objectives": [case for cases in shown_groups(measured).values() for case in cases],
            "negatives": list(shown_cases(measured).values())}


@pytest.mark.parametrize("new_entry", [False, True], ids=["table", "with a new entry"])
def test_the_docs_rows_show_a_measured_case_of_every_entry_of_the_table(new_entry, monkeypatch):
    """Every case a docs table shows is one the benchmark measures (a misspelt label
    fails), and every objective of the table has a row, a new entry with no bench edit."""
    if new_entry:
        monkeypatch.setitem(OBJECTIVES, "decoupled", ObjectiveSpec(decoupled, plain_decoupled))
    measured = [*objective_cases(*small_inputs()), *PEER_ROWS]
    for table, shown in shown_rows(measured).items():
        assert set(shown) <= set(measured), (table, set(shown) - set(measured))
        assert {objective_of(case) for case in shown} - PEER_ROWS == set(OBJECTIVES), table


def test_a_case_computes_what_the_objective_computes_on_what_its_entry_declares():
    inputs = small_inputs()
    z, ids, labels, captions, graph, text, _ = inputs
    cases = objective_cases(*inputs)
    assert cases["supcon"]() == batch_loss("supcon", z, ids, labels, temperature=0.1,
                                           num_classes=CLASSES)[0]
    assert cases["xclr[class_graph]"]() == batch_loss("xclr", z, ids, labels, temperature=0.1,
                                                      class_graph=graph)[0]
    assert cases["xclr[captions, top_k=5]"]() == batch_loss(
        "xclr", z, ids, temperature=0.1, captions=captions, top_k=5)[0]
    half = N // 2
    assert cases["clip"]() == batch_loss("clip", z[:half], ids[:half], temperature=0.1,
                                         text=text[:half])[0]
    for case, loss in cases.items():
        value = loss()
        assert torch.isfinite(value), case
        value.backward()  # the loss parameters (ProjNCE's, SigLIP's) are leaves too


@pytest.mark.parametrize("tile_size", [None, 4])
def test_a_new_entry_is_a_case_with_no_bench_edit(monkeypatch, tile_size):
    monkeypatch.setitem(OBJECTIVES, "decoupled", ObjectiveSpec(decoupled, plain_decoupled))
    cases = objective_cases(*small_inputs(), tile_size=tile_size)
    assert torch.isfinite(cases["decoupled"]())


def recipe_objective(recipe: str) -> str:
    text = (Path(configs.RECIPES) / recipe).read_text()
    return yaml.safe_load(text)["objective"]["name"]


def test_the_learning_benchmark_trains_every_entry_of_the_table():
    trained = {recipe_objective(recipe) for recipe, *_ in configs.OBJECTIVES.values()}
    assert trained == set(OBJECTIVES), set(OBJECTIVES) ^ trained
