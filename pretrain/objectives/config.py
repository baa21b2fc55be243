"""Configuration of the training objective (``objective.*`` in the run config)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, make_dataclass
from typing import Any, ClassVar

from torch import Tensor

from core.config import InvalidValue
from pretrain.contrast.parameters import ParameterShape, initial_values
from pretrain.contrast.temperature import EssControlConfig
from pretrain.objectives.table import OBJECTIVES, objective_spec


@dataclass
class SharedObjectiveConfig:
    """``objective.*``: which objective, its temperature, the negatives it sees and its
    tiles, what every objective shares. :data:`ObjectiveConfig` adds the sections."""

    name: str = "infonce"  # an entry of pretrain/objectives/table.py (docs/objectives.md)
    temperature: float = 0.1  # tau of the similarity logits (initial value if learnable)
    learnable_temperature: bool = False  # learn tau (stored as log tau) with the model
    num_negatives: int | None = None  # per-anchor random subset of k negatives; null = all
    negatives_seed: int = 0  # the subset is reseeded from (seed, step) every step
    tile_size: int | None = None  # column tile width (docs/negatives.md); null = automatic
    ess_control: EssControlConfig = field(default_factory=EssControlConfig)  # ESS steering

    # keys that moved into an objective's section: refused, naming where they went
    MOVED: ClassVar[dict[str, str]] = {
        "eps": "eps_supinfonce.eps", "gamma": "holder_flatnce.gamma",
        "target_temperature": "xclr.target_temperature", "class_graph": "xclr.class_graph",
        "projection": "projnce.projection", "bandwidth": "projnce.bandwidth",
        "kernel_metric": "projnce.kernel_metric", "bias": "siglip.bias"}

    def validate(self) -> None:
        spec = objective_spec(self.name)
        if not self.temperature > 0:
            raise InvalidValue("temperature", f"must be > 0, got {self.temperature}")
        if self.tile_size is not None and self.tile_size < 1:
            raise InvalidValue("tile_size", f"must be >= 1 or null, got {self.tile_size}")
        if self.num_negatives is not None and self.num_negatives < 1:
            raise InvalidValue("num_negatives", f"must be >= 1 or null, got {self.num_negatives}")
        if self.ess_control.enabled and self.learnable_temperature:
            raise InvalidValue("ess_control.enabled",
                               "cannot steer a learnable temperature; choose one")
        if self.ess_control.enabled and not spec.softmax:
            raise InvalidValue("ess_control.enabled",
                               f"{self.name} has no softmax over negatives to steer by ESS")

    @classmethod
    def of(cls, name: str, **keys: Any) -> SharedObjectiveConfig:
        """Objective ``name``'s configuration from one set of keywords: the shared keys as
        they are, the objective's own into its section
        (``ObjectiveConfig.of("projnce", projection="kernel", temperature=0.2)``)."""
        shared = {f.name for f in fields(SharedObjectiveConfig)}
        own = {key: keys.pop(key) for key in list(keys) if key not in shared}
        if own:
            section = objective_spec(name).config
            if section is None:
                raise TypeError(f"{name} has no keys of its own, got {sorted(own)}")
            keys[name] = section(**own)
        return cls(name=name, **keys)

    @property
    def class_graph_key(self) -> str:
        """``objective.<name>.class_graph``, the key that names a soft-target objective's
        class graph file (its table entry's ``soft_targets``); "" for other objectives."""
        return f"objective.{self.name}.class_graph" if objective_spec(self.name).soft_targets \
            else ""

    @property
    def class_graph_path(self) -> str:
        """The class graph file a soft-target objective takes its targets from; "" when it
        takes them from ``data.caption_store``, and for other objectives."""
        return self.own.class_graph if self.class_graph_key else ""

    @property
    def own(self) -> Any:
        """The chosen objective's own section (None for an objective without keys)."""
        return getattr(self, self.name) if objective_spec(self.name).config else None

    def hparams(self) -> dict[str, Any]:
        """Keyword arguments of the chosen objective function (its table entry's keys)."""
        return {key: getattr(self.own, key) for key in objective_spec(self.name).hparams}

    def loss_parameters(self, shape: ParameterShape) -> dict[str, Tensor]:
        """Initial values of the learnable loss parameters the model owns for this
        objective, for a run of ``shape`` (its class count and projection width)."""
        own = vars(self.own) if self.own is not None else {}
        return initial_values(objective_spec(self.name).parameters, own, shape)


# ``objective.*``: the shared keys plus one section per objective whose table entry
# declares a config, ``objective.<name>.*`` (e.g. ``objective.xclr.target_temperature``):
# a new objective's keys come with its table entry, nothing to add here
ObjectiveConfig = make_dataclass(
    "ObjectiveConfig",
    [(name, spec.config, field(default_factory=spec.config))
     for name, spec in OBJECTIVES.items() if spec.config is not None],
    bases=(SharedObjectiveConfig,), namespace={"__module__": __name__})
