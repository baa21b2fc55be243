"""The files of a registered version, without pickle: the encoder's weights
(``encoder.safetensors``), for CLIP and SigLIP runs the text tower's
(``text_tower.safetensors``), for ProjNCE runs with learned class embeddings those
(``class_embeddings.safetensors``), the run's resolved configuration (``config.yaml``) and
a model card (``model_card.md``); their SHA-256 digests, checked file by file; and the
encoder rebuilt from them with the project's own code.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from torch import Tensor, nn

from core.config import from_dict
from core.errors import RunError
from data_pipeline.manifest import file_sha256
from pretrain.model.encoder import Encoder, ModelConfig
from pretrain.model.text_tower import TextTower

WEIGHTS, CONFIG, CARD = "encoder.safetensors", "config.yaml", "model_card.md"
TEXT_WEIGHTS = "text_tower.safetensors"  # runs with a text tower only
CLASS_EMBEDDINGS = "class_embeddings.safetensors"  # runs that learned class embeddings only


class RegistryError(RunError):
    """A registered model that our loaders refuse: missing, unverifiable or altered."""


class EmbeddingModel(nn.Module):
    """The backbone plus projector; ``forward(images [B, 3, R, R]) -> [B, P]``,
    ``features(images) -> [B, F]`` gives the backbone output for evaluation. ``text`` is
    CLIP's text tower (token ids [B, L], mask [B, L] -> [B, P]) when the run trained one;
    ``class_embeddings`` [C, P] ProjNCE's learned class embeddings when the run learned them
    (a buffer: evaluated, never trained here)."""

    def __init__(self, encoder: nn.Module, text: TextTower | None = None,
                 class_embeddings: Tensor | None = None) -> None:
        super().__init__()
        self.encoder = encoder
        self.text = text
        self.class_embeddings: Tensor | None
        self.register_buffer("class_embeddings", class_embeddings)

    def forward(self, images: Tensor) -> Tensor:
        return self.encoder(images)[1]

    def features(self, images: Tensor) -> Tensor:
        return self.encoder(images)[0]


@dataclass
class ModelCard:
    """What a registered version is: written next to its weights as Markdown."""

    name: str
    objective: dict[str, Any]
    data: dict[str, Any]
    training: dict[str, Any]
    knn: dict[str, float]

    def markdown(self) -> str:
        def table(rows: dict[str, Any]) -> list[str]:
            return ["| key | value |", "|---|---|",
                    *(f"| {k} | {v} |" for k, v in rows.items())]

        knn = table(self.knn) if self.knn else [
            "Not measured during training (train.knn_every = 0); `evaluate` records its "
            "numbers on the evaluation run and the version's tag `knn_top1`."]
        return "\n".join([f"# {self.name}", "", "Encoder (backbone + projector) trained by "
                          "contrastive-pretrain; weights in safetensors, configuration in "
                          "config.yaml.", "", "## Objective", *table(self.objective), "",
                          "## Data", *table(self.data), "", "## Training",
                          *table(self.training), "", "## kNN monitor (top-1)", *knn, ""])


def _save_tensors(state: dict[str, Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    state = {k: v.detach().float().cpu().contiguous() if v.is_floating_point()
             else v.detach().cpu().contiguous() for k, v in state.items()}
    save_file(state, str(path), metadata={"format": "pt"})


def write_package(directory: Path, model: EmbeddingModel, config_yaml: str,
                  card: ModelCard) -> dict[str, str]:
    """Write weights (the text tower's too, when there is one), configuration and card
    into ``directory``; returns MLflow's ``artifacts`` mapping (name -> local path)."""
    _save_tensors(model.encoder.state_dict(), directory / WEIGHTS)
    names = [WEIGHTS, CONFIG, CARD]
    if model.text is not None:
        _save_tensors(model.text.state_dict(), directory / TEXT_WEIGHTS)
        names.append(TEXT_WEIGHTS)
    if model.class_embeddings is not None:
        _save_tensors({"class_embeddings": model.class_embeddings},
                      directory / CLASS_EMBEDDINGS)
        names.append(CLASS_EMBEDDINGS)
    (directory / CONFIG).write_text(config_yaml)
    (directory / CARD).write_text(card.markdown())
    return {name.split(".")[0]: str(directory / name) for name in names}


def digest_tree(root: Path) -> dict[str, str]:
    """{path relative to ``root``: SHA-256 hex} of every file under ``root``."""
    return {path.relative_to(root).as_posix(): file_sha256(path)
            for path in sorted(p for p in root.rglob("*") if p.is_file())}


def verify_tree(root: Path, expected: dict[str, str], source: str) -> None:
    """Raise :class:`RegistryError` naming the first file of ``root`` that is missing,
    unexpected or differs from its registered digest."""
    found = digest_tree(root)
    for name in sorted(set(found) | set(expected)):
        if name not in found:
            raise RegistryError(f"{source}: file {name} is missing from the artifact store")
        if name not in expected:
            raise RegistryError(f"{source}: file {name} was not registered with this version; "
                                "refusing to load it (the artifact store was changed)")
        if found[name] != expected[name]:
            raise RegistryError(f"{source}: file {name} does not match its registered SHA-256 "
                                "digest; refusing to load it (the artifact store was changed)")


def load_package(root: Path) -> tuple[EmbeddingModel, dict[str, Any]]:
    """Rebuild the encoder from a verified package directory (the logged model's root or
    its ``artifacts/``): (model in eval mode, the run's configuration tree)."""
    from safetensors.torch import load_file

    folder = root / "artifacts" if (root / "artifacts").is_dir() else root
    tree = yaml.safe_load((folder / CONFIG).read_text()) or {}
    cfg = from_dict(ModelConfig, tree.get("model", {}), prefix="model.")
    encoder = Encoder(cfg)
    encoder.load_state_dict(load_file(str(folder / WEIGHTS)))
    text = None
    if (folder / TEXT_WEIGHTS).is_file():
        text = TextTower(cfg.text, cfg.projector_dim)
        text.load_state_dict(load_file(str(folder / TEXT_WEIGHTS)))
    classes = None
    if (folder / CLASS_EMBEDDINGS).is_file():
        classes = load_file(str(folder / CLASS_EMBEDDINGS))["class_embeddings"]
    return EmbeddingModel(encoder, text, classes).eval(), tree
