"""The encoder: a backbone plus the 2-layer projector to 128 dimensions (SimCLR, X-CLR).

Backbones (:mod:`pretrain.model.backbones`): torchvision ResNet-18 / ResNet-50, a small CNN for
fast CPU runs, and any timm model (``timm:vit_small_patch16_224``). ``Encoder.forward``
returns (features [B, F], projections [B, P]); the objectives normalise the projections,
evaluation uses the features.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

import torch
from torch import Tensor, nn

from core.config import InvalidValue
from pretrain.contrast.parameters import ParameterShape
from pretrain.model.activation_checkpointing import every_of
from pretrain.model.backbones import (
    backbone_blocks,
    build_backbone,
    check_backbone,
    checkpoint_backbone,
)
from pretrain.model.text_tower import TextTower, TextTowerConfig
from pretrain.objectives.config import ObjectiveConfig
from pretrain.objectives.table import objective_spec


@dataclass
class ModelConfig:
    """``model.*``: the backbone and the projector."""

    backbone: str = "small_cnn"  # small_cnn, resnet18, resnet50 or timm:<model> (docs/training.md)
    image_size: int = 0  # input size the backbone is built for (timm ViTs); 0 = data.resolution
    patch_size: int = 0  # timm ViTs: patch size; 0 = the model's own
    # keywords for timm.create_model (global_pool: avg, class_token: false, ...)
    timm_kwargs: dict[str, Any] = field(default_factory=dict)  # timm:<model> only
    # conv: a ViT's patchify replaced by 3x3 stride-2 convolutions (Xiao et al. 2021);
    # hybrid: by the small CNN's blocks of model.width channels (Dosovitskiy et al. 2021)
    vit_stem: Literal["patch", "conv", "hybrid"] = "patch"  # timm ViTs: the stem of the tokens
    width: int = 64  # small_cnn: channels of the first block (then x2, x4, x4)
    small_stem: bool = True  # resnet: 3x3/1 stem without max-pool, for 32-64 px images
    projector_hidden: int = 512  # hidden width of the 2-layer projector
    projector_dim: int = 128  # output width of the projector (the contrastive embedding)
    projector_bn_out: bool = True  # batch-normalise the output (SimCLR's head): no collapse
    projector_activation: Literal["relu", "gelu"] = "relu"  # gelu: open_clip's timm head
    norm: Literal["batch", "group"] = "batch"  # group: independent of the batch split
    sync_batchnorm: bool = True  # batch norm over the global batch on multi-GPU runs
    split_views: bool = False  # batch-norm statistics per view set (first views, second views)
    channels_last: bool = True  # channels-last images everywhere, and weights on GPU
    # blocks recomputed in the backward instead of held (pretrain/model/activation_checkpointing.py)
    activation_checkpointing: Literal["none", "full"] | int = "none"  # none, full, or every k
    text: TextTowerConfig = field(default_factory=TextTowerConfig)  # clip's text tower

    def validate(self) -> None:
        check_backbone(self)
        for key in ("image_size", "patch_size"):
            if getattr(self, key) < 0:
                raise InvalidValue(key, f"must be >= 0, got {getattr(self, key)}")
        if isinstance(self.activation_checkpointing, int) and self.activation_checkpointing < 1:
            raise InvalidValue("activation_checkpointing", "none, full, or k >= 1 (every k-th "
                               f"block), got {self.activation_checkpointing}")
        for key in ("width", "projector_hidden", "projector_dim"):
            if getattr(self, key) < 1:
                raise InvalidValue(key, f"must be >= 1, got {getattr(self, key)}")
        if self.norm == "group" and self.projector_bn_out:
            raise InvalidValue("projector_bn_out", "norm=group makes the encoder independent "
                               "of how the batch is split, a batch-normalised output would "
                               "not be: set model.projector_bn_out=false with it")


def projector(features: int, cfg: ModelConfig) -> nn.Sequential:
    """Linear - norm - ReLU (or GELU) - linear to ``projector_dim``, then
    (``projector_bn_out``) a batch norm without affine parameters and the last linear without
    bias, as SimCLR's head: every output dimension is centred over the batch, so the
    embeddings cannot all move to one point (``docs/learning.md``, "Why SupCon collapsed")."""
    hidden = cfg.projector_hidden
    activation = nn.ReLU(inplace=True) if cfg.projector_activation == "relu" else nn.GELU()
    layers = [nn.Linear(features, hidden, bias=False),
              nn.BatchNorm1d(hidden) if cfg.norm == "batch" else nn.GroupNorm(8, hidden),
              activation, nn.Linear(hidden, cfg.projector_dim, bias=not cfg.projector_bn_out)]
    if cfg.projector_bn_out:
        layers.append(nn.BatchNorm1d(cfg.projector_dim, affine=False))
    return nn.Sequential(*layers)


class Encoder(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.backbone, features = build_backbone(cfg)
        self.backbone_name = cfg.backbone
        self.feature_dim, self.embedding_dim = features, cfg.projector_dim
        self.projector = projector(features, cfg)
        self.channels_last = cfg.channels_last

    def forward(self, images: Tensor) -> tuple[Tensor, Tensor]:
        """images [B, 3, H, W] -> (features [B, F], projections [B, P]). Channels-last
        images take oneDNN's NHWC convolutions on CPU even with contiguous weights (faster:
        ``python -m bench.perf.channels_last``, docs/benchmarks.md). Float64 parameters
        (``train.precision=fp64``) take the images in float64."""
        if self.projector[0].weight.dtype == torch.float64:
            images = images.double()
        if self.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        features = self.backbone(images)
        return features, self.projector(features)


class ModelOutput(NamedTuple):
    """features [B, F], projections [B, P], text [B, P] (clip, siglip), learnable
    temperature [], and the objective's learnable loss parameters by name (SigLIP's bias
    [], ProjNCE's class embeddings [C, D])."""

    features: Tensor | None
    projections: Tensor
    text: Tensor | None
    temperature: Tensor | None
    loss_parameters: dict[str, Tensor]


class ContrastiveModel(nn.Module):
    """Everything the engine trains: the encoder, a text tower when the objective needs
    one, a learnable temperature (stored as log tau) when asked for, and the objective's
    learnable loss parameters (``loss_parameters``: name -> initial tensor, e.g. SigLIP's
    bias, ProjNCE's class embeddings). Temperature and loss parameters come out of
    ``forward`` so wrappers (DDP) see them used there; the step hands them to the objective
    (as open_clip's model owns ``logit_scale`` and ``logit_bias``). A 0-dim parameter is
    stored with shape [1] (DeepSpeed cannot flatten 0-dim parameters) and handed out as []."""

    def __init__(self, cfg: ModelConfig, with_text: bool = False,
                 learnable_temperature: float | None = None,
                 loss_parameters: dict[str, Tensor] | None = None) -> None:
        super().__init__()
        self.encoder = Encoder(cfg)
        self.split_views = cfg.split_views
        self.text = TextTower(cfg.text, cfg.projector_dim) if with_text else None
        self.log_temperature = None
        if learnable_temperature is not None:
            # shape [1], not [] (DeepSpeed cannot flatten 0-dim parameters)
            self.log_temperature = nn.Parameter(torch.tensor([learnable_temperature]).log())
        initial = loss_parameters or {}
        self.loss_parameters = nn.ParameterDict(
            {name: nn.Parameter(value.detach().float().reshape(value.shape or (1,)).clone())
             for name, value in initial.items()})
        self._loss_parameter_shapes = {name: value.shape for name, value in initial.items()}

    def blocks(self) -> list[nn.Module]:
        """The backbone's blocks and the text tower's layers, in order: the units a
        sharding engine wraps one by one (the rest is the root's)."""
        text = [] if self.text is None else self.text.layers()
        return backbone_blocks(self.encoder.backbone, self.encoder.backbone_name) + text

    def forward(self, images: Tensor, input_ids: Tensor | None = None,
                attention_mask: Tensor | None = None, text_repeats: int = 1) -> ModelOutput:
        """images [R, 3, H, W]; token ids and mask [R / text_repeats, L], each text row
        standing for ``text_repeats`` image rows (the first R / k, repeated k times)."""
        if self.split_views and self.training:
            # [2B] = first views then second views; each half is its own batch for the
            # norms, so a view's statistics do not carry its partner's
            halves = [self.encoder(half) for half in images.chunk(2)]
            features = torch.cat([h[0] for h in halves])
            projections = torch.cat([h[1] for h in halves])
        else:
            features, projections = self.encoder(images)
        text = None if self.text is None else self.text(input_ids, attention_mask)
        if text is not None and text_repeats > 1:
            text = text.repeat(text_repeats, 1)
        temperature = (None if self.log_temperature is None
                       else self.log_temperature.squeeze(0).exp())
        loss_parameters = {name: owned(p.reshape(self._loss_parameter_shapes[name]))
                           for name, p in self.loss_parameters.items()}
        return ModelOutput(owned(features), projections, text, temperature, loss_parameters)


def owned(tensor: Tensor) -> Tensor:
    """``tensor``, copied if it is a view (a ViT's class token, a reshaped parameter): an
    in-place op on a view that FSDP2's root returns would bypass its backward hooks, and
    FSDP2 warns of every such output."""
    return tensor.clone() if tensor._is_view() else tensor


def build_model(cfg: ModelConfig, objective: ObjectiveConfig, device: torch.device,
                num_classes: int = 0) -> ContrastiveModel:
    """The model a run trains: the encoder, plus what the objective's table entry asks
    for (a text tower, learnable loss parameters shaped by the shards' ``num_classes``) and
    a learnable temperature (initialised at ``objective.temperature``) when asked for."""
    temperature = objective.temperature if objective.learnable_temperature else None
    with torch.random.fork_rng(devices=[]):  # the encoder's init draws as without them
        parameters = objective.loss_parameters(ParameterShape(num_classes, cfg.projector_dim))
    model = ContrastiveModel(cfg, objective_spec(objective.name).text_tower, temperature,
                             parameters).to(device)
    every = every_of(cfg.activation_checkpointing)
    checkpoint_backbone(model.encoder.backbone, cfg.backbone, every)
    if model.text is not None and every:
        model.text.checkpoint(every)
    if device.type == "cuda":
        if cfg.channels_last:
            model.encoder = model.encoder.to(memory_format=torch.channels_last)
        if cfg.sync_batchnorm and cfg.norm == "batch":
            model.encoder = nn.SyncBatchNorm.convert_sync_batchnorm(model.encoder)
    return model


def _part(model_state: dict[str, Tensor], prefix: str) -> dict[str, Tensor]:
    return {key[len(prefix):]: value for key, value in model_state.items()
            if key.startswith(prefix)}


def encoder_from_state(cfg: ModelConfig, model_state: dict[str, Tensor]) -> Encoder:
    """The encoder of a trained :class:`ContrastiveModel`, from that model's state dict
    (text tower, temperature and loss parameters, if any, are left out)."""
    encoder = Encoder(cfg)
    encoder.load_state_dict(_part(model_state, "encoder."))
    return encoder


def text_tower_from_state(cfg: ModelConfig, model_state: dict[str, Tensor]) -> TextTower | None:
    """CLIP's text tower of a trained :class:`ContrastiveModel` (None if it has none)."""
    state = _part(model_state, "text.")
    if not state:
        return None
    tower = TextTower(cfg.text, cfg.projector_dim)
    tower.load_state_dict(state)
    return tower


def class_embeddings_from_state(model_state: dict[str, Tensor]) -> Tensor | None:
    """ProjNCE's learned [C, D] class embeddings of a trained model (None if it has none)."""
    return _part(model_state, "loss_parameters.").get("class_embeddings")
