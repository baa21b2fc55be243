"""The table of objectives: each one's function and what it needs from the run.

The run reads these entries instead of checking names: configuration checks (labels,
soft targets), the model (a text tower, learnable loss parameters), the loader (tokenised
captions) and the objective's keyword arguments. Adding an objective is its file and an
entry here; the tests and the benchmarks take it from here, and ask for its row in
``docs/objectives.md`` and its recipe for the learning benchmark (docs/architecture.md,
"Adding an objective"). The backbones and the engines keep their tables the same way.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from core.tables import table_entry
from pretrain.contrast.batch import ContrastiveBatch
from pretrain.contrast.common import ObjectiveOutput, Temperature
from pretrain.contrast.parameters import LossParameter, class_embeddings_when_learned, scalar_from
from pretrain.objectives.clip import clip, plain_clip
from pretrain.objectives.eps_supinfonce import (
    EpsSupInfoNCEConfig,
    eps_supinfonce,
    plain_eps_supinfonce,
)
from pretrain.objectives.flatnce import flatnce, plain_flatnce
from pretrain.objectives.holder_flatnce import (
    HolderFlatNCEConfig,
    holder_flatnce,
    plain_holder_flatnce,
)
from pretrain.objectives.infonce import infonce, plain_infonce
from pretrain.objectives.projnce import ProjNCEConfig, plain_projnce, projnce
from pretrain.objectives.siglip import SigLIPConfig, plain_siglip, siglip
from pretrain.objectives.sincere import plain_sincere, sincere
from pretrain.objectives.supcon import plain_supcon, supcon
from pretrain.objectives.xclr import XclrConfig, plain_xclr, xclr

ObjectiveFn = Callable[..., ObjectiveOutput]
# (rows: BatchRows, tau, **keys and loss parameters) -> the loss as its paper writes it
PlainForm = Callable[..., Tensor]


@dataclass(frozen=True)
class ObjectiveSpec:
    """An objective and what it needs."""

    fn: ObjectiveFn  # (batch: ContrastiveBatch, temperature, **hparams) -> ObjectiveOutput
    # its definition, dense and in full: what every test holds ``fn`` to, on every path
    plain: PlainForm
    # its own keys, objective.<name>.*: a dataclass beside ``fn`` (defaults written there)
    config: type | None = None
    hparams: tuple[str, ...] = ()  # keys of ``config`` passed to ``fn`` as keywords
    # learnable loss parameters the model owns and hands to ``fn`` as keywords
    # (pretrain/contrast/parameters.py; as open_clip's model owns logit_bias)
    parameters: tuple[LossParameter, ...] = ()
    labels: bool = False  # positives share a class label: the shards must list classes
    # targets from a class graph (its section's class_graph key) or data.caption_store
    soft_targets: bool = False
    text_tower: bool = False  # image-caption pairs: a text tower, captions tokenised
    softmax: bool = True  # reports a softmax's monitors (ess), which ess_control steers by
    # the settings of its own keys every test matrix checks it under (beside the defaults)
    examples: tuple[dict[str, object], ...] = ({},)

    def defaults(self) -> dict[str, object]:
        """Its own keys at the defaults its configuration writes."""
        config = self.config() if self.config is not None else None
        return {key: getattr(config, key) for key in self.hparams}

    def bound(self, **keys: object) -> ObjectiveFn:
        """``fn`` with its own keys bound: ``keys``, else their defaults; called as
        ``(batch, temperature, **loss_parameters)``."""
        return functools.partial(self.fn, **(self.defaults() | keys))

    def settings(self) -> list[dict[str, object]]:
        """What every matrix checks it under: its defaults ({}), then each example that
        changes one of them."""
        defaults = self.defaults()
        return [{}, *(dict(e) for e in self.examples if e and defaults | dict(e) != defaults)]


OBJECTIVES: dict[str, ObjectiveSpec] = {
    "infonce": ObjectiveSpec(infonce, plain_infonce),
    "supcon": ObjectiveSpec(supcon, plain_supcon, labels=True),
    "sincere": ObjectiveSpec(sincere, plain_sincere, labels=True),
    "eps_supinfonce": ObjectiveSpec(eps_supinfonce, plain_eps_supinfonce, EpsSupInfoNCEConfig,
                                    ("eps",), labels=True, examples=({"eps": 0.3},)),
    "flatnce": ObjectiveSpec(flatnce, plain_flatnce),
    "holder_flatnce": ObjectiveSpec(holder_flatnce, plain_holder_flatnce, HolderFlatNCEConfig,
                                    ("gamma",), examples=({"gamma": 1.5},)),
    "xclr": ObjectiveSpec(xclr, plain_xclr, XclrConfig, ("target_temperature", "top_k"),
                          soft_targets=True, examples=({"target_temperature": 0.3},
                                                       {"top_k": 5})),
    "projnce": ObjectiveSpec(
        projnce, plain_projnce, ProjNCEConfig,
        ("projection", "bandwidth", "kernel_metric", "neighbours"),
        parameters=(LossParameter("class_embeddings", class_embeddings_when_learned),),
        labels=True, examples=(
            {"projection": "centroid"}, {"projection": "kernel", "bandwidth": 2.0},
            {"projection": "kernel", "bandwidth": 3.0, "neighbours": 3},
            {"projection": "median"}, {"projection": "learned"})),
    "clip": ObjectiveSpec(clip, plain_clip, text_tower=True),
    # bias: the configured start, bound as a default; a run's model hands in its learned
    # bias (the parameter below) at every step, which takes its place
    "siglip": ObjectiveSpec(siglip, plain_siglip, SigLIPConfig, ("bias",),
                            parameters=(LossParameter("bias", scalar_from("bias")),),
                            text_tower=True, softmax=False, examples=({"bias": -2.0},)),
}


def objective_function(name: str, **keys: object) -> Callable[..., ObjectiveOutput]:
    """Objective ``name``'s function with its own keys bound: ``keys``, else the defaults
    of its configuration (``objective.<name>.*``); called as ``(batch, temperature,
    **loss_parameters)``, on a batch that holds what its entry declares, in full
    precision."""
    spec = objective_spec(name)
    return functools.partial(_declared_call, name, spec, spec.bound(**keys))


@contextlib.contextmanager
def declared(name: str, spec: ObjectiveSpec, batch: ContrastiveBatch) -> Iterator[None]:
    """Around a call of objective ``name`` on ``batch``: the batch holds what ``spec``
    declares, and autocast is off on its device, so every loss computes in float32, or
    float64 when given float64."""
    if spec.labels and batch.labels is None:
        raise ValueError(f"{name}: needs class labels (labels=, an [N] tensor); use infonce "
                         "for instance positives")
    if spec.text_tower and batch.text is None:
        raise ValueError(f"{name}: needs the second modality's embeddings (text=)")
    with torch.autocast(device_type=batch.candidates.device.type, enabled=False):
        yield


def _declared_call(name: str, spec: ObjectiveSpec, fn: ObjectiveFn, batch: ContrastiveBatch,
                   temperature: Temperature, **loss_parameters: Tensor) -> ObjectiveOutput:
    with declared(name, spec, batch):
        return fn(batch, temperature, **loss_parameters)


def objective_spec(name: str) -> ObjectiveSpec:
    """The entry of objective ``name``; :class:`InvalidValue` for ``objective.name``,
    naming the choices, if there is none."""
    return table_entry(OBJECTIVES, name, "name", "objective")
