"""Activation checkpointing (``model.activation_checkpointing``): a checkpointed block keeps
only its input in the forward and runs again in the backward to rebuild what its gradient
needs, so a step holds one block's activations at a time instead of every block's, for
about one more forward of those blocks.

``none``; ``full`` (every block); or k, every k-th block (blocks 0, k, 2k, ...), which
trades memory against the recomputation in between. What a block is, each backbone's table
entry says (``BackboneSpec.checkpoint``): a transformer block of a timm ViT, a stage of a
ResNet, a convolution-norm-ReLU-pool block of the small CNN, a layer of the text tower.

Blocks are wrapped with PyTorch's ``checkpoint_wrapper`` (non-reentrant), whose state-dict
hooks keep every key as the unwrapped model has it, so checkpoints, the registry and the
optimiser's parameter names do not change. Batch norm inside a block would update its
running statistics a second time when the block runs again; :func:`held_norm_statistics`
puts them back, so a checkpointed run equals an unchecked one in weights, gradients and
buffers. timm's own mechanism (``set_grad_checkpointing``) serves ``full`` on timm
models that have no ``blocks`` list (their CNNs).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Literal

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    CheckpointWrapper,
    checkpoint_wrapper,
)

from core.errors import RunError

Setting = Literal["none", "full"] | int  # model.activation_checkpointing


def every_of(setting: Setting) -> int:
    """0 (none), or checkpoint every k-th block (1: every block)."""
    return {"none": 0, "full": 1}.get(setting, setting)  # type: ignore[arg-type]


Contexts = tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]


@contextlib.contextmanager
def held_norm_statistics(modules: Iterable[nn.Module]) -> Iterator[None]:
    """The running statistics of the batch norms in ``modules`` as they were on entry, put
    back on exit (around a block's second forward in the backward)."""
    norms = [m for module in modules for m in module.modules()
             if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    saved = [[b.clone() for b in m.buffers()] for m in norms]
    try:
        yield
    finally:
        for norm, buffers in zip(norms, saved, strict=True):
            for live, kept in zip(norm.buffers(), buffers, strict=True):
                live.copy_(kept)


def recompute_contexts(modules: list[nn.Module]) -> Callable[[], Contexts]:
    """``torch.utils.checkpoint``'s ``context_fn`` for a block of ``modules``: nothing
    around the forward, the batch-norm statistics held around the recomputation."""
    return lambda: (contextlib.nullcontext(), held_norm_statistics(modules))


def recompute_options(modules: list[nn.Module]) -> dict[str, Callable[[], Contexts]]:
    """``torch.utils.checkpoint``'s keywords for a block of ``modules``: the context that
    holds batch-norm statistics where it has batch norm, none otherwise, which keeps the
    block compilable (``train.compile``: torch.compile takes only dispatch modes there)."""
    if not any(has_batch_norm(m) for m in modules):
        return {}
    return {"context_fn": recompute_contexts(modules)}


def checkpointed(block: nn.Module) -> nn.Module:
    """``block`` wrapped: its activations recomputed in the backward, its keys unchanged."""
    return checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT,
                              **recompute_options([block]))


def has_batch_norm(module: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in module.modules())


def check_compilable(backbone: nn.Module, name: str, setting: Setting) -> None:
    """``train.compile`` with checkpointed blocks: refused in one line when a checkpointed
    block holds batch norm, whose statistics the recomputation puts back through a context
    that torch.compile cannot trace (it fails in the first step)."""
    if every_of(setting) and recomputes_batch_norm(backbone):
        raise RunError(f"train.compile=true with model.activation_checkpointing={setting}: "
                       f"model.backbone={name} checkpoints blocks with batch norm, which "
                       "torch.compile cannot trace; set one of them off")


def recomputes_batch_norm(backbone: nn.Module) -> bool:
    """Whether a checkpointed block of ``backbone`` holds batch norm: a wrapped block, or
    the small CNN's segments (it checkpoints its own, ``checkpoint_every``)."""
    wrapped = [m for m in backbone.modules() if isinstance(m, CheckpointWrapper)]
    return any(has_batch_norm(m) for m in wrapped) or (
        getattr(backbone, "checkpoint_every", 0) > 0 and has_batch_norm(backbone))


def checkpoint_children(container: nn.Module, every: int) -> int:
    """Wrap children 0, k, 2k, ... of ``container`` (k = ``every``); returns how many."""
    chosen = [(name, child) for i, (name, child) in enumerate(container.named_children())
              if i % every == 0]
    for name, child in chosen:
        container.register_module(name, checkpointed(child))
    return len(chosen)
