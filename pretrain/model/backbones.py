"""The table of backbones: the built-in ones by name, and any timm model as
``timm:<name>`` (built without pretrained weights: nothing is downloaded).

An entry's factory takes the name and the model configuration and returns the network,
which maps images [B, 3, H, W] to features [B, F], and F; the entry declares which
``model.*`` keys the backbone takes. Adding a backbone is a factory, its entry in
:data:`BACKBONES`, its test and a line in ``docs/training.md`` (docs/architecture.md,
"Adding a backbone"). A ViT's tokenizer is chosen from :data:`STEMS` the same way.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torchvision
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from core.config import InvalidValue
from core.errors import RunError, first_line
from core.tables import table_entry
from pretrain.model.activation_checkpointing import (
    checkpoint_children,
    checkpointed,
    recompute_options,
)


class BackboneConfig(Protocol):
    """The ``model.*`` keys a backbone reads (:class:`pretrain.model.encoder.ModelConfig`)."""

    backbone: str
    image_size: int
    patch_size: int
    timm_kwargs: dict[str, Any]
    vit_stem: str
    width: int
    small_stem: bool
    norm: str


TIMM = "timm:"  # prefix of a timm model name in model.backbone
TIMM_FAMILY = f"{TIMM}<model name>"  # the table's entry for every timm model


class Backbone(NamedTuple):
    """The network (images [B, 3, H, W] -> features [B, F]) and F."""

    net: nn.Module
    features: int


def norm_layer(kind: str) -> Callable[[int], nn.Module]:
    """Batch norm, or group norm (8 groups), which gives every sample the same output
    however the global batch is split over ranks (no SyncBatchNorm on CPU/gloo)."""
    return nn.BatchNorm2d if kind == "batch" else (lambda channels: nn.GroupNorm(8, channels))


def cnn_block(channels: int, out: int, norm: str) -> list[nn.Module]:
    """One block of the small CNN: 3x3 convolution, norm, ReLU, 2x2 max-pool."""
    return [nn.Conv2d(channels, out, 3, padding=1, bias=False), norm_layer(norm)(out),
            nn.ReLU(inplace=True), nn.MaxPool2d(2)]


class SmallCNN(nn.Sequential):
    """Four blocks of :func:`cnn_block` (4 layers each), then global pooling; blocks 0, k,
    2k, ... run checkpointed when ``checkpoint_every`` k > 0 (one flat sequence, so its
    keys are those of the plain ``nn.Sequential``)."""

    BLOCK = 4  # layers of a cnn_block
    checkpoint_every = 0

    def forward(self, images: Tensor) -> Tensor:
        if not self.checkpoint_every:
            return super().forward(images)
        layers, x = list(self), images
        blocks = len(layers) // self.BLOCK  # then the pooling (none in a slice of blocks)
        for block in range(blocks):
            segment = layers[block * self.BLOCK:(block + 1) * self.BLOCK]
            run = functools.partial(run_layers, segment)
            if block % self.checkpoint_every == 0:
                x = checkpoint(run, x, use_reentrant=False, **recompute_options(segment))
            else:
                x = run(x)
        return run_layers(layers[blocks * self.BLOCK:], x)


def run_layers(layers: list[nn.Module], x: Tensor) -> Tensor:
    for layer in layers:
        x = layer(x)
    return x


def small_cnn(name: str, cfg: BackboneConfig) -> Backbone:
    """Four conv-norm-ReLU blocks with pooling: a few million MACs per 32 px image."""
    layers: list[nn.Module] = []
    channels = 3
    width = cfg.width
    for out in (width, width * 2, width * 4, width * 4):
        layers += cnn_block(channels, out, cfg.norm)
        channels = out
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten()]
    return Backbone(SmallCNN(*layers), channels)


def checkpoint_small_cnn(net: nn.Module, every: int, name: str) -> None:
    net.checkpoint_every = every


def resnet(name: str, cfg: BackboneConfig) -> Backbone:
    """torchvision's ResNet ``name``; ``small_stem`` replaces the 7x7/2 stem and max-pool by
    a 3x3/1 convolution for 32-64 px images (SINCERE's CIFAR runs)."""
    net = getattr(torchvision.models, name)(weights=None, norm_layer=norm_layer(cfg.norm))
    if cfg.small_stem:
        net.conv1 = nn.Conv2d(3, 64, 3, stride=1, padding=1, bias=False)
        net.maxpool = nn.Identity()
    features = net.fc.in_features
    net.fc = nn.Identity()
    return Backbone(net, features)


RESNET_STAGES = ("layer1", "layer2", "layer3", "layer4")


def checkpoint_resnet(net: nn.Module, every: int, name: str) -> None:
    """Stages 0, k, 2k, ... of the four."""
    for stage in RESNET_STAGES[::every]:
        setattr(net, stage, checkpointed(getattr(net, stage)))


def resnet_blocks(net: nn.Module) -> list[nn.Module]:
    """The four residual stages."""
    return [getattr(net, stage) for stage in RESNET_STAGES]


def timm_blocks(net: nn.Module) -> list[nn.Module]:
    """The transformer blocks (``net.blocks``) or, for a timm CNN, its ``stages``; none
    when the model has neither."""
    for attribute in ("blocks", "stages"):
        blocks = getattr(net, attribute, None)
        if isinstance(blocks, nn.Sequential | nn.ModuleList):
            return list(blocks)
    return []


def no_blocks(net: nn.Module) -> list[nn.Module]:
    """A network small enough to be one unit."""
    return []


def timm_backbone(name: str, cfg: BackboneConfig) -> Backbone:
    """timm's model ``name`` without its classifier (``num_classes=0``: pooled features),
    built for ``cfg.image_size`` where the model takes an image size (ViTs: the position
    embeddings), ``cfg.patch_size`` where set, and ``cfg.timm_kwargs`` (pooling, class
    token, ...) passed to ``timm.create_model`` as they are."""
    import timm

    shaped = {**cfg.timm_kwargs, **({"patch_size": cfg.patch_size} if cfg.patch_size else {})}
    sized = {**shaped, "img_size": cfg.image_size} if cfg.image_size else shaped
    try:
        try:
            net = timm.create_model(name, pretrained=False, num_classes=0, **sized)
        except TypeError as err:
            if "img_size" not in str(err) or "img_size" in cfg.timm_kwargs:
                raise
            # a model without an image size (a CNN) takes any
            net = timm.create_model(name, pretrained=False, num_classes=0, **shaped)
    except (TypeError, ValueError, AssertionError) as err:
        keys = ", ".join(f"model.{k}" for k in ("patch_size", "timm_kwargs")
                         if getattr(cfg, k))
        raise RunError(f"{keys or 'model.backbone'}: {TIMM}{name} refuses "
                       f"{shaped or 'these settings'} ({first_line(err)})") from None
    if cfg.vit_stem != "patch":
        patch_embed = getattr(net, "patch_embed", None)
        if patch_embed is None or not isinstance(getattr(patch_embed, "proj", None), nn.Conv2d):
            raise RunError(f"model.vit_stem={cfg.vit_stem}: {TIMM}{name} has no patch "
                           "embedding to replace; set model.vit_stem=patch")
        patch_embed.proj = STEMS[cfg.vit_stem](patch_embed.proj, cfg)
    return Backbone(net, int(net.num_features))


def checkpoint_timm(net: nn.Module, every: int, name: str) -> None:
    """The transformer blocks (``net.blocks``) 0, k, 2k, ...; a timm model without a
    ``blocks`` list takes ``full`` through timm's own ``set_grad_checkpointing``."""
    blocks = getattr(net, "blocks", None)
    if isinstance(blocks, nn.Sequential | nn.ModuleList):
        checkpoint_children(blocks, every)
    elif every == 1 and hasattr(net, "set_grad_checkpointing"):
        net.set_grad_checkpointing(True)
    else:
        raise RunError(f"model.activation_checkpointing={every}: {TIMM}{name} has no list of "
                       "blocks to choose from; set model.activation_checkpointing=full "
                       "(timm's own checkpointing)")


def _stages(patchify: nn.Conv2d, stem: str) -> int:
    """log2(p) of a square power-of-2 patchify of stride p, else one line naming the key."""
    patch = patchify.kernel_size[0]
    if patch < 2 or patch & (patch - 1) or patchify.stride != patchify.kernel_size:
        raise RunError(f"model.vit_stem={stem} needs a square power-of-2 patch size, "
                       f"got {patchify.kernel_size}")
    return patch.bit_length() - 1


def conv_stem(patchify: nn.Conv2d, cfg: BackboneConfig) -> nn.Sequential:
    """A convolutional stem in place of a ViT's patchify convolution (Xiao et al. 2021,
    "Early Convolutions Help Transformers See Better", Sec. 3): log2(p) 3x3 stride-2
    convolution - norm - ReLU blocks, widening to the embedding width, then a 1x1
    convolution; the same [B, D, H / p, W / p] tokens as the p x p patchify."""
    stages, dim = _stages(patchify, "conv"), patchify.out_channels
    widths = [max(dim // 2 ** (stages - 1 - i), 8) for i in range(stages)]
    layers: list[nn.Module] = []
    channels = patchify.in_channels
    for width in widths:
        layers += [nn.Conv2d(channels, width, 3, stride=2, padding=1, bias=False),
                   norm_layer(cfg.norm)(width), nn.ReLU(inplace=True)]
        channels = width
    layers.append(nn.Conv2d(channels, dim, 1))
    return nn.Sequential(*layers)


def hybrid_stem(patchify: nn.Conv2d, cfg: BackboneConfig) -> nn.Sequential:
    """A CNN's feature map as the tokens (the hybrid of Dosovitskiy et al. 2021, "An Image
    is Worth 16x16 Words", Sec. 3.1): log2(p) blocks of the small CNN (3x3 stride-1
    convolution - norm - ReLU - 2x2 max-pool) of ``model.width`` x 1, 2, 4, ... channels,
    then a 1x1 convolution to the embedding width; the same [B, D, H / p, W / p] tokens as
    the p x p patchify, each seeing a (2^(s+2) - 3)-pixel neighbourhood after s blocks."""
    stages, dim = _stages(patchify, "hybrid"), patchify.out_channels
    layers: list[nn.Module] = []
    channels = patchify.in_channels
    for stage in range(stages):
        width = cfg.width * 2 ** stage
        layers += cnn_block(channels, width, cfg.norm)
        channels = width
    layers.append(nn.Conv2d(channels, dim, 1))
    return nn.Sequential(*layers)


STEMS: dict[str, Callable[[nn.Conv2d, BackboneConfig], nn.Module]] = {
    "conv": conv_stem,
    "hybrid": hybrid_stem,
}


@dataclass(frozen=True)
class BackboneSpec:
    """A backbone and what it takes from ``model.*``."""

    build: Callable[[str, BackboneConfig], Backbone]  # (name, model config) -> network, F
    # (network, k, name): checkpoint blocks 0, k, 2k, ...
    # (pretrain/model/activation_checkpointing.py)
    checkpoint: Callable[[nn.Module, int, str], None]
    # network -> its blocks in order, the units engine.name=fsdp2 shards one by one
    blocks: Callable[[nn.Module], list[nn.Module]]
    # the backbone-specific model.* keys it reads; any other keeps its neutral value
    takes: tuple[str, ...] = ()
    layers: bool = False  # declares its layers to optim.layer_decay (timm's group_matcher)
    # a family's check of a member's name: why it is refused, or None
    name_problem: Callable[[str], str | None] = lambda name: None
    # (name, model config) -> why timm cannot build this backbone with the same parameters
    # under the same name (export.format=timm), or None
    timm_problem: Callable[[str, BackboneConfig], str | None] = (
        lambda name, cfg: f"{name} is not a timm architecture")


def resnet_timm_problem(name: str, cfg: BackboneConfig) -> str | None:
    """timm's ResNets share torchvision's parameter names, with the standard stem."""
    if cfg.small_stem:
        return "its 32 px stem (model.small_stem=true) is not a timm architecture"
    return None if cfg.norm == "batch" else "timm's ResNets take batch norm only"


def timm_stem_problem(name: str, cfg: BackboneConfig) -> str | None:
    return None if cfg.vit_stem == "patch" else (f"model.vit_stem={cfg.vit_stem} is not a "
                                                 "timm architecture")


def timm_name_problem(name: str) -> str | None:
    import timm

    return None if timm.is_model(name) else "timm has no such model (timm.list_models() lists them)"


BACKBONES: dict[str, BackboneSpec] = {
    "small_cnn": BackboneSpec(small_cnn, checkpoint_small_cnn, no_blocks, ("width",)),
    "resnet18": BackboneSpec(resnet, checkpoint_resnet, resnet_blocks, ("small_stem",),
                             timm_problem=resnet_timm_problem),
    "resnet50": BackboneSpec(resnet, checkpoint_resnet, resnet_blocks, ("small_stem",),
                             timm_problem=resnet_timm_problem),
    # a family: timm:<name> is any timm model, the entry's factory gets <name>
    TIMM_FAMILY: BackboneSpec(timm_backbone, checkpoint_timm, timm_blocks,
                              ("patch_size", "timm_kwargs", "vit_stem", "width"),
                              layers=True, name_problem=timm_name_problem,
                              timm_problem=timm_stem_problem),
}
NEUTRAL = {"patch_size": 0, "timm_kwargs": {}, "vit_stem": "patch"}  # the keys' "not in use"


def split_name(name: str) -> tuple[str, str]:
    """(table key, the name its factory gets): ``timm:vit_tiny`` -> (:data:`TIMM_FAMILY`,
    ``vit_tiny``)."""
    return (TIMM_FAMILY, name[len(TIMM):]) if name.startswith(TIMM) else (name, name)


def backbone_spec(name: str) -> BackboneSpec:
    """The entry of backbone ``name``; :class:`InvalidValue` for ``model.backbone``, naming
    the choices, if there is none (or the family has no such model)."""
    key, member = split_name(name)
    spec = table_entry(BACKBONES, key, "backbone", "backbone")
    problem = spec.name_problem(member)
    if problem is not None:
        raise InvalidValue("backbone", f"{name}: {problem}")
    return spec


def check_backbone(cfg: BackboneConfig) -> None:
    """:class:`InvalidValue` for an unknown backbone, or a key set that it does not take."""
    spec = backbone_spec(cfg.backbone)
    for key, neutral in NEUTRAL.items():
        if key not in spec.takes and getattr(cfg, key) != neutral:
            takers = [name for name, entry in BACKBONES.items() if key in entry.takes]
            raise InvalidValue(key, f"only for {' or '.join(takers)} backbones, "
                                    f"not {cfg.backbone}")


def build_backbone(cfg: BackboneConfig) -> Backbone:
    """The network ``cfg.backbone`` names."""
    key, member = split_name(cfg.backbone)
    return BACKBONES[key].build(member, cfg)


def checkpoint_backbone(net: nn.Module, name: str, every: int) -> None:
    """Activation checkpointing of blocks 0, k, 2k, ... (k = ``every``; 0: none) of
    backbone ``name``, built as ``net``."""
    if every:
        key, member = split_name(name)
        BACKBONES[key].checkpoint(net, every, member)


def backbone_blocks(net: nn.Module, name: str) -> list[nn.Module]:
    """The blocks of backbone ``name``, built as ``net`` (checkpointed ones wrapped)."""
    return BACKBONES[split_name(name)[0]].blocks(net)
