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
- ``open_clip``: CLIP and SigLIP runs whose heads open_clip expresses
  (``serving/open_clip_folder.py``): ``open_clip.create_model_and_transforms("local-dir:DIR")``
  gives our image and text embeddings.

Each format is an entry of :data:`FORMATS`: what it writes, and why a backbone cannot take
it (one line naming the formats it can).
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Literal, NamedTuple

import torch
import yaml
from torch import Tensor, nn

from core.config import from_dict
from core.errors import RunError
from core.tables import table_entry
from data_pipeline.transforms import MEAN, STD
from pretrain.contrast.parameters import ParameterShape
from pretrain.model.backbones import backbone_spec, split_name
from pretrain.model.encoder import ModelConfig
from pretrain.objectives.config import ObjectiveConfig
from registry.evaluation_record import (
    EvaluationRecord,
    card_table,
    model_index,
    unevaluated_line,
)
from registry.package import EmbeddingModel
from registry.versions import ModelRef, add_card_line
from serving import open_clip_folder

BUNDLED_HUB_ID = "sentence-transformers/all-MiniLM-L6-v2"  # the bundled sentence model
CROP_PCT = 7 / 8  # the evaluation view: short side to 8/7 R, centre crop R


@dataclass
class ExportConfig:
    """``export.*``: which encoder leaves, in which format, to where."""

    model: str = ""  # a checkpoint directory, runs:/<id>/encoder or models:/<name>/<version>
    format: str = ""  # an entry of FORMATS: onnx, timm, open_clip
    output: str = ""  # a directory that is new or empty (or export.overwrite=true)
    overwrite: bool = False  # replace what export.output holds
    space: Literal["", "backbone", "projector"] = ""  # "": the format's (onnx, timm: backbone)
    repo_id: str = ""  # timm: the Hugging Face repository its card names (nothing is pushed)

    def validate(self) -> None:
        if self.format:
            format_spec(self.format)


class Exported(NamedTuple):
    """What leaves: the model, its ``model.*`` configuration, the run's configuration tree,
    where it came from and the evaluation recorded on it."""

    model: EmbeddingModel
    cfg: ModelConfig
    tree: dict[str, Any]
    source: str
    evaluation: EvaluationRecord | None = None  # the registered version's, when evaluated

    @property
    def resolution(self) -> int:
        return int(self.tree.get("data", {}).get("resolution", self.cfg.image_size or 32))

    @property
    def image_size(self) -> int:
        """The size the backbone is built for (a ViT's patch grid)."""
        return self.cfg.image_size or self.resolution


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
    evaluation = (asdict(item.evaluation) if item.evaluation is not None
                  else unevaluated_line(item.source.startswith("models:/")))
    for key, value in {**view(item), "space": cfg.space, "backbone": item.cfg.backbone,
                       "source": item.source, "evaluation": evaluation}.items():
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
        sized["img_size"] = item.image_size
    state = {k: v.detach().contiguous() for k, v in backbone.state_dict().items()
             if not k.startswith("fc.")}
    save_file(state, str(out / "model.safetensors"))
    config = {"architecture": name, "num_classes": 0,
              "num_features": int(item.model.encoder.feature_dim), "model_args": sized,
              "pretrained_cfg": {**view(item), "num_classes": 0}}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "README.md").write_text(timm_card(item, name, cfg.repo_id))


def open_clip_problem(item: Exported) -> str | None:
    """Why open_clip cannot load this encoder as ours (None: it can)."""
    if item.model.text is None:
        return "an open_clip folder holds an image and a text tower, and this run has no " \
               "text tower (clip and siglip runs train one)"
    problem = timm_problem(item.cfg) or open_clip_folder.head_problem(item.cfg)
    if problem is None and hasattr(item.model.encoder.backbone, "patch_embed"):
        import timm

        default = timm.get_pretrained_cfg(timm_architecture(item.cfg)[0]).input_size[-1]
        if item.image_size != default:
            problem = (f"open_clip builds a ViT at its default size ({default} px), this one "
                       f"has {item.image_size} px")
    return problem


def write_open_clip(item: Exported, out: Path, cfg: ExportConfig) -> None:
    from safetensors.torch import save_file

    from data_pipeline.text import BUNDLED, model_path

    encoder, text = item.model.encoder, item.model.text
    objective = from_dict(ObjectiveConfig, item.tree.get("objective", {}), prefix="objective.")
    initial = objective.loss_parameters(ParameterShape(0, item.cfg.projector_dim))
    bias = float(initial["bias"]) if "bias" in initial else None  # SigLIP's logit bias
    pool = getattr(encoder.backbone, "global_pool", "avg")
    text_model = item.cfg.text.model
    name = BUNDLED_HUB_ID if text_model == BUNDLED else str(Path(text_model).resolve())
    save_file(open_clip_folder.state_dict(encoder.backbone, encoder.projector, text,
                                          math.log(1 / objective.temperature), bias),
              str(out / "open_clip_model.safetensors"))
    config = {"model_cfg": open_clip_folder.model_config(
                  timm_architecture(item.cfg)[0], pool if isinstance(pool, str) else "avg",
                  item.image_size, item.cfg, name, bias),
              "preprocess_cfg": {"size": item.resolution, "mean": list(MEAN), "std": list(STD),
                                 "interpolation": "bilinear", "resize_mode": "shortest"}}
    (out / "open_clip_config.json").write_text(json.dumps(config, indent=2) + "\n")
    open_clip_folder.copy_tokenizer(Path(model_path(text_model)), out)
    (out / "README.md").write_text(open_clip_card(item, timm_architecture(item.cfg)[0]))


def recipe(item: Exported) -> dict[str, Any]:
    """The training recipe a card shows."""
    objective = item.tree.get("objective", {})
    train, data = item.tree.get("train", {}), item.tree.get("data", {})
    return {"objective": objective.get("name", "?"),
            "temperature": objective.get("temperature", "?"),
            "epochs": train.get("epochs", "?"),
            "batch_size_per_rank": data.get("batch_size", "?"),
            "resolution": item.resolution, "augment": data.get("augment", "?")}


def evaluation_section(item: Exported) -> list[str]:
    """The card's figures (:mod:`registry.evaluation_record`), or the one line saying why
    there are none."""
    if item.evaluation is None:
        return [unevaluated_line(item.source.startswith("models:/"))]
    return card_table(item.evaluation)


def model_card(item: Exported, library: str, title: str, usage: list[str],
               what: str) -> str:
    """A Hugging Face model card: the metadata block (``model-index`` when the version has
    been evaluated), what the encoder is, how to load it, its evaluation and its recipe."""
    trained = recipe(item)
    meta: dict[str, Any] = {"library_name": library,
                            "pipeline_tag": "image-feature-extraction",
                            "tags": ["image-feature-extraction", library,
                                     "contrastive-learning", str(trained["objective"])]}
    if item.evaluation is not None:
        meta["model-index"] = model_index(item.evaluation, title)
    lines = ["---", yaml.safe_dump(meta, sort_keys=False).rstrip(), "---", "", f"# {title}",
             "", f"{what} trained with {trained['objective']}, exported from "
             f"`{item.source}`.", "", "```python", *usage, "```", "",
             "## Evaluation", "", *evaluation_section(item), "",
             "## Training recipe", "", "| key | value |", "|---|---|",
             *(f"| {k} | {v} |" for k, v in trained.items()), ""]
    return "\n".join(lines)


def timm_card(item: Exported, architecture: str, repo_id: str) -> str:
    where = f"hf-hub:{repo_id}" if repo_id else "local-dir:<this folder>"
    usage = ["import timm", "",
             f'model = timm.create_model("{where}", pretrained=True).eval()',
             "config = timm.data.resolve_data_config(model=model)",
             "transform = timm.data.create_transform(**config)"]
    what = (f"The backbone of a contrastive encoder (features "
            f"[B, {item.model.encoder.feature_dim}], no classifier)")
    return model_card(item, "timm", repo_id or f"{architecture} contrastive encoder", usage,
                      what)


def open_clip_card(item: Exported, architecture: str) -> str:
    usage = ["import open_clip", "",
             'model, _, preprocess = open_clip.create_model_and_transforms(',
             '    "local-dir:<this folder>")',
             'tokenizer = open_clip.get_tokenizer("local-dir:<this folder>")']
    what = (f"An image-text encoder ({architecture} image tower and its text tower, "
            f"embeddings [B, {item.cfg.projector_dim}])")
    return model_card(item, "open_clip", f"{architecture} contrastive image-text encoder",
                      usage, what)


@dataclass(frozen=True)
class FormatSpec:
    """An export format: what it writes into the output folder, why an encoder cannot take
    it (None: it can), and the spaces it holds (the first is the default)."""

    write: Callable[[Exported, Path, ExportConfig], None]
    problem: Callable[[Exported], str | None]
    spaces: tuple[str, ...]


FORMATS: dict[str, FormatSpec] = {
    "onnx": FormatSpec(write_onnx, lambda item: None, ("backbone", "projector")),
    "timm": FormatSpec(write_timm, lambda item: timm_problem(item.cfg), ("backbone",)),
    # the image tower's projector output and the text tower's, as the model was trained
    "open_clip": FormatSpec(write_open_clip, open_clip_problem, ("projector",)),
}


def format_spec(name: str) -> FormatSpec:
    """The entry of export format ``name``; :class:`InvalidValue` naming the choices."""
    return table_entry(FORMATS, name, "format", "export format")


def formats_for(item: Exported) -> list[str]:
    return [name for name, spec in FORMATS.items() if spec.problem(item) is None]


def chosen_space(cfg: ExportConfig) -> str:
    """``export.space``, or the format's default space."""
    return cfg.space or format_spec(cfg.format).spaces[0]


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
        add_card_line(client, ref,
                      f"Exported as {fmt}: `{link}` (load it as docs/export.md shows).")
    return link


def export(item: Exported, cfg: ExportConfig) -> Path:
    """Write ``item`` in ``cfg.format`` to ``cfg.output``."""
    spec = format_spec(cfg.format)
    problem = spec.problem(item)
    if problem is not None:
        raise RunError(f"export.format={cfg.format}: {problem}; this encoder exports as "
                       f"{', '.join(formats_for(item))}")
    cfg = replace(cfg, space=chosen_space(cfg))
    if cfg.space not in spec.spaces:
        raise RunError(f"export.space={cfg.space}: a {cfg.format} export holds the "
                       f"{' or '.join(spec.spaces)} space; export the {cfg.space} as onnx")
    out = check_output(cfg)
    spec.write(item, out, cfg)
    return out
