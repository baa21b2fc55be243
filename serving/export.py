"""An encoder in the formats other libraries load (``export``; ``docs/export.md``).

- ``onnx``: every backbone. ``model.onnx`` (its weights in ``model.onnx.data`` beside it)
  from ``torch.onnx.export`` (the dynamo exporter) with a dynamic batch; input ``images``
  float32 [B, 3, R, R] normalised as the run's evaluation view, output the chosen space's
  features; the view (input size, mean, std, crop) in the model's metadata. onnxruntime
  gives our features within 1e-4.
- ``timm``: a Hugging Face style folder (``config.json``, ``model.safetensors``,
  ``README.md``) for backbones timm builds: ``timm:<name>`` with the patch stem, and
  ResNet-18/50 with the standard stem (``model.small_stem=false``: timm's ResNets share
  torchvision's keys). ``timm.create_model("local-dir:DIR", pretrained=True)`` gives our
  backbone features; ``timm.data.resolve_data_config`` gives the run's view. The backbone
  only (timm has no projector).

Each format is an entry of :data:`FORMATS`: what it writes, and why a backbone cannot take
it (one line naming the formats it can).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NamedTuple

import torch
from torch import Tensor, nn

from core.errors import RunError
from core.tables import table_entry
from data_pipeline.transforms import MEAN, STD
from pretrain.model.backbones import backbone_spec, split_name
from pretrain.model.encoder import ModelConfig
from serving.model_registry import EmbeddingModel, ModelRef

CROP_PCT = 7 / 8  # the evaluation view: short side to 8/7 R, centre crop R


@dataclass
class ExportConfig:
    """``export.*``: which encoder leaves, in which format, to where."""

    model: str = ""  # a checkpoint directory, runs:/<id>/encoder or models:/<name>/<version>
    format: str = ""  # an entry of FORMATS: onnx, timm
    output: str = ""  # a directory that is new or empty (or export.overwrite=true)
    overwrite: bool = False  # replace what export.output holds
    space: Literal["backbone", "projector"] = "backbone"  # onnx: the features exported
    repo_id: str = ""  # timm: the Hugging Face repository its card names (nothing is pushed)

    def validate(self) -> None:
        if self.format:
            format_spec(self.format)


class Exported(NamedTuple):
    """What leaves: the model, its ``model.*`` configuration, the run's configuration tree
    and where it came from."""

    model: EmbeddingModel
    cfg: ModelConfig
    tree: dict[str, Any]
    source: str

    @property
    def resolution(self) -> int:
        return int(self.tree.get("data", {}).get("resolution", self.cfg.image_size or 32))


class Space(nn.Module):
    """images [B, 3, R, R] -> the ``space``'s features, as one module for an exporter."""

    def __init__(self, model: EmbeddingModel, space: str) -> None:
        super().__init__()
        self.model, self.space = model, space

    def forward(self, images: Tensor) -> Tensor:
        features, projections = self.model.encoder(images)
        return features if self.space == "backbone" else projections


def view(item: Exported) -> dict[str, Any]:
    """The run's evaluation view, as timm's ``pretrained_cfg`` names it."""
    return {"input_size": [3, item.resolution, item.resolution], "interpolation": "bilinear",
            "crop_pct": CROP_PCT, "crop_mode": "center", "mean": list(MEAN), "std": list(STD)}


def write_onnx(item: Exported, out: Path, cfg: ExportConfig) -> None:
    import onnx

    path = out / "model.onnx"
    images = torch.zeros(2, 3, item.resolution, item.resolution)
    torch.onnx.export(Space(item.model, cfg.space).eval(), (images,), str(path),
                      input_names=["images"], output_names=[cfg.space],
                      dynamic_shapes={"images": {0: torch.export.Dim("batch")}},
                      dynamo=True, verbose=False)
    graph = onnx.load(str(path), load_external_data=False)  # large weights stay beside it
    for key, value in {**view(item), "space": cfg.space, "backbone": item.cfg.backbone,
                       "source": item.source}.items():
        entry = graph.metadata_props.add()
        entry.key, entry.value = key, json.dumps(value)
    onnx.save(graph, str(path))


def timm_architecture(cfg: ModelConfig) -> tuple[str, dict[str, Any]]:
    """(timm's model name, its keyword arguments) for a backbone timm builds as we do."""
    _, name = split_name(cfg.backbone)
    shaped = {**cfg.timm_kwargs, **({"patch_size": cfg.patch_size} if cfg.patch_size else {})}
    return name, shaped


def timm_problem(cfg: ModelConfig) -> str | None:
    """Why timm cannot load this backbone (the backbone table's entry says), or None."""
    return backbone_spec(cfg.backbone).timm_problem(split_name(cfg.backbone)[1], cfg)


def write_timm(item: Exported, out: Path, cfg: ExportConfig) -> None:
    from safetensors.torch import save_file

    name, kwargs = timm_architecture(item.cfg)
    backbone = item.model.encoder.backbone
    sized = dict(kwargs)
    if hasattr(backbone, "patch_embed"):  # a ViT is built for its image size
        sized["img_size"] = item.cfg.image_size or item.resolution
    state = {k: v.detach().contiguous() for k, v in backbone.state_dict().items()
             if not k.startswith("fc.")}
    save_file(state, str(out / "model.safetensors"))
    config = {"architecture": name, "num_classes": 0,
              "num_features": int(item.model.encoder.feature_dim), "model_args": sized,
              "pretrained_cfg": {**view(item), "num_classes": 0}}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "README.md").write_text(model_card(item, name, cfg.repo_id))


def model_card(item: Exported, architecture: str, repo_id: str) -> str:
    """A Hugging Face model card: the metadata block, what the encoder is, how to load it,
    and the recipe it was trained with."""
    objective = item.tree.get("objective", {})
    train, data = item.tree.get("train", {}), item.tree.get("data", {})
    title = repo_id or f"{architecture} contrastive encoder"
    where = f"hf-hub:{repo_id}" if repo_id else "local-dir:<this folder>"
    recipe = {"objective": objective.get("name", "?"),
              "temperature": objective.get("temperature", "?"),
              "epochs": train.get("epochs", "?"),
              "batch_size_per_rank": data.get("batch_size", "?"),
              "resolution": item.resolution, "augment": data.get("augment", "?")}
    lines = ["---", "library_name: timm", "pipeline_tag: image-feature-extraction",
             "tags:", "- image-feature-extraction", "- timm", "- contrastive-learning",
             f"- {recipe['objective']}", "---", "", f"# {title}", "",
             f"The backbone of an encoder trained with {recipe['objective']} (features "
             f"[B, {item.model.encoder.feature_dim}], no classifier), exported from "
             f"`{item.source}`.", "", "```python", "import timm", "",
             f'model = timm.create_model("{where}", pretrained=True).eval()',
             "config = timm.data.resolve_data_config(model=model)",
             "transform = timm.data.create_transform(**config)", "```", "",
             "## Training recipe", "", "| key | value |", "|---|---|",
             *(f"| {k} | {v} |" for k, v in recipe.items()), ""]
    return "\n".join(lines)


@dataclass(frozen=True)
class FormatSpec:
    """An export format: what it writes into the output folder, and why a backbone cannot
    take it (None: it can)."""

    write: Callable[[Exported, Path, ExportConfig], None]
    problem: Callable[[ModelConfig], str | None]


FORMATS: dict[str, FormatSpec] = {
    "onnx": FormatSpec(write_onnx, lambda cfg: None),
    "timm": FormatSpec(write_timm, timm_problem),
}


def format_spec(name: str) -> FormatSpec:
    """The entry of export format ``name``; :class:`InvalidValue` naming the choices."""
    return table_entry(FORMATS, name, "format", "export format")


def formats_for(cfg: ModelConfig) -> list[str]:
    return [name for name, spec in FORMATS.items() if spec.problem(cfg) is None]


def check_output(cfg: ExportConfig) -> Path:
    """``export.output`` as a directory to write: new, empty, or replaced with overwrite."""
    out = Path(cfg.output)
    if out.exists() and not out.is_dir():
        raise RunError(f"export.output={out}: a file, not a directory")
    if out.is_dir() and any(out.iterdir()):
        if not cfg.overwrite:
            raise RunError(f"export.output={out}: not empty; choose another directory or set "
                           "export.overwrite=true")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    return out


def log_export(folder: Path, ref: ModelRef, uri: str, fmt: str) -> str:
    """Attach ``folder`` to the MLflow run the encoder came from, under ``export/<fmt>``; a
    registered version's model card (its description) gains a line linking it. Returns the
    ``runs:/`` URI of the attached folder."""
    from mlflow import MlflowClient

    if not ref.run_id:
        raise RunError(f"--log-artifact: export.model={ref.source} belongs to no MLflow run "
                       "(a run trained with tracking.enabled=false)")
    client = MlflowClient(uri)
    client.log_artifacts(ref.run_id, str(folder), artifact_path=f"export/{fmt}")
    link = f"runs:/{ref.run_id}/export/{fmt}"
    if ref.name and ref.version:
        card = client.get_model_version(ref.name, ref.version).description or ""
        line = f"Exported as {fmt}: `{link}` (load it as docs/export.md shows)."
        if line not in card:
            client.update_model_version(ref.name, ref.version,
                                        description=f"{card}\n\n{line}".lstrip())
    return link


def export(item: Exported, cfg: ExportConfig) -> Path:
    """Write ``item`` in ``cfg.format`` to ``cfg.output``."""
    spec = format_spec(cfg.format)
    problem = spec.problem(item.cfg)
    if problem is not None:
        raise RunError(f"export.format={cfg.format}: {problem}; this encoder exports as "
                       f"{', '.join(formats_for(item.cfg))}")
    if cfg.format == "timm" and cfg.space != "backbone":
        raise RunError("export.space=projector: a timm folder holds the backbone only; "
                       "export the projector as onnx")
    out = check_output(cfg)
    spec.write(item, out, cfg)
    return out
