"""A CLIP or SigLIP encoder as an open_clip ``local-dir:`` folder (``export.format=open_clip``).

open_clip builds the image tower as a timm trunk with its default arguments, pooled, then
``Mlp(F, 2P, P)`` (fc1 - GELU - fc2, both with bias; ``timm_proj=mlp``), and the text tower
as a Hugging Face transformer, mean-pooled over the padding mask, then a linear projection
without bias (``hf_proj_type=linear``). Our projector (linear - batch norm - activation -
linear - batch norm) in eval mode is that ``Mlp`` once each batch norm is folded into the
linear before it, provided its activation is GELU and its hidden width 2P; our text tower
is open_clip's when its projection has no bias. :func:`head_problem` says which setting
differs; :func:`folded_projector` folds in float64.

The folder: ``open_clip_config.json`` (``model_cfg``, ``preprocess_cfg``),
``open_clip_model.safetensors``, and the sentence model's ``config.json`` and tokenizer
files (open_clip reads a ``local-dir:`` tokenizer from the folder itself).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from pretrain.model.encoder import ModelConfig

TOKENIZER_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "vocab.txt",
                   "special_tokens_map.json")


def head_problem(cfg: ModelConfig) -> str | None:
    """Why open_clip's heads cannot express this model's (None: they can)."""
    wanted = {"model.projector_activation": (cfg.projector_activation, "gelu"),
              "model.projector_hidden": (cfg.projector_hidden, 2 * cfg.projector_dim),
              "model.norm": (cfg.norm, "batch"),
              "model.text.projection_bias": (cfg.text.projection_bias, False)}
    for key, (have, want) in wanted.items():
        if have != want:
            return (f"open_clip's heads need {key}={str(want).lower()} (this run has "
                    f"{str(have).lower()})")
    extra = sorted(set(cfg.timm_kwargs) - {"global_pool"})
    if extra or cfg.patch_size:
        return ("open_clip builds the timm trunk with its default arguments (model."
                f"{'timm_kwargs: ' + ', '.join(extra) if extra else 'patch_size'} differs)")
    return None


def folded_projector(projector: nn.Sequential) -> dict[str, Tensor]:
    """Our eval-mode projector as open_clip's ``Mlp`` (``fc1``, ``fc2``: weight and bias):
    each batch norm y = (x - mean) / sqrt(var + eps) * gamma + beta folded into the linear
    before it, in float64 (:func:`state_dict` stores them in float32)."""
    first, norm, _, second, *rest = projector

    def fold(linear: nn.Linear, bn: nn.BatchNorm1d | None) -> tuple[Tensor, Tensor]:
        weight = linear.weight.detach().double()
        bias = (torch.zeros(weight.shape[0], dtype=torch.float64) if linear.bias is None
                else linear.bias.detach().double())
        if bn is None:
            return weight, bias
        scale = (bn.running_var.double() + bn.eps).rsqrt()
        shift = -bn.running_mean.double() * scale
        if bn.affine:
            gamma, beta = bn.weight.double(), bn.bias.double()
            scale, shift = scale * gamma, shift * gamma + beta
        return weight * scale[:, None], bias * scale + shift

    w1, b1 = fold(first, norm)
    w2, b2 = fold(second, rest[0] if rest else None)
    return {"fc1.weight": w1, "fc1.bias": b1, "fc2.weight": w2, "fc2.bias": b2}


def state_dict(backbone: nn.Module, projector: nn.Sequential, text: nn.Module,
               logit_scale: float, logit_bias: float | None) -> dict[str, Tensor]:
    """open_clip's ``CustomTextCLIP`` keys: ``visual.trunk.*`` (the backbone, no classifier),
    ``visual.head.mlp.*``, ``text.transformer.*`` (no pooler: open_clip mean-pools),
    ``text.proj.weight``, ``logit_scale`` (ln 1/tau) and SigLIP's ``logit_bias``."""
    state = {f"visual.trunk.{k}": v for k, v in backbone.state_dict().items()
             if not k.startswith("fc.")}
    state |= {f"visual.head.mlp.{k}": v for k, v in folded_projector(projector).items()}
    state |= {f"text.transformer.{k}": v for k, v in text.transformer.state_dict().items()
              if not k.startswith("pooler.")}
    state["text.proj.weight"] = text.projection.weight
    state["logit_scale"] = torch.tensor(logit_scale)
    if logit_bias is not None:
        state["logit_bias"] = torch.tensor(logit_bias)
    return {k: v.detach().float().contiguous() for k, v in state.items()}


def model_config(architecture: str, pool: str, image_size: int, cfg: ModelConfig,
                 text_model_name: str, logit_bias: float | None) -> dict[str, Any]:
    """``model_cfg`` of ``open_clip_config.json``."""
    config: dict[str, Any] = {
        "embed_dim": cfg.projector_dim,
        "vision_cfg": {"timm_model_name": architecture, "timm_model_pretrained": False,
                       "timm_pool": pool, "timm_proj": "mlp", "timm_proj_bias": True,
                       "image_size": image_size},
        "text_cfg": {"hf_model_name": text_model_name, "hf_tokenizer_name": text_model_name,
                     "hf_model_pretrained": False, "hf_proj_type": "linear",
                     "hf_pooler_type": "mean_pooler", "context_length": cfg.text.max_length}}
    if logit_bias is not None:
        config["init_logit_bias"] = logit_bias
    return config


def copy_tokenizer(model_dir: Path, out: Path) -> None:
    """The sentence model's configuration and tokenizer files, which open_clip reads from a
    ``local-dir:`` folder."""
    for name in TOKENIZER_FILES:
        if (model_dir / name).is_file():
            shutil.copyfile(model_dir / name, out / name)
